"""The six pyprojects and the `patrl` meta-package: every third-party module a package's source
imports is declared by that package (a dependency or one of its extras), patrl dependencies
point only to the package's left, and the meta-package installs exactly the six.

Read from the files with `ast` and `tomllib`; nothing is installed or imported. That a package
installs alone from the checkout and imports is `nox -s install_check`'s job.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test dependencies bring tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["kvstore", "tpreshard", "lenpredict", "rollout", "trainer", "orchestrator"]
# DESIGN.md's directions: the patrl packages each one may depend on.
ALLOWED_PATRL = {
    "kvstore": set(),
    "tpreshard": set(),
    "lenpredict": set(),
    "rollout": {"kvstore", "tpreshard", "lenpredict"},
    "trainer": set(),
    "orchestrator": {"rollout", "trainer", "lenpredict"},
}
# Import name -> distribution, where they differ.
DISTRIBUTION = {"yaml": "pyyaml", "math_verify": "math-verify", "flash_attn": "flash-attn"}
# Imported but shipped by another distribution: triton by torch's CUDA wheels (the Triton
# kernels load on CUDA only).
PROVIDED = {"triton": "torch"}


def project(package: str | None) -> dict:
    path = (
        ROOT / "pyproject.toml"
        if package is None
        else ROOT / "packages" / package / "pyproject.toml"
    )
    return tomllib.loads(path.read_text())["project"]


def requirement_name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    assert name is not None, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def declared(package: str) -> set[str]:
    """Every distribution the package names: dependencies and every extra's."""
    p = project(package)
    extras = p.get("optional-dependencies", {}).values()
    return {requirement_name(r) for r in [*p["dependencies"], *(r for e in extras for r in e)]}


def imported(package: str, src: Path | None = None) -> dict[str, str]:
    """Top-level third-party module -> one place it is imported, over the package's sources
    (or those under `src`)."""
    found: dict[str, str] = {}
    src = src or ROOT / "packages" / package / "src"
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "patrl" and top not in sys.stdlib_module_names:
                    found.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_every_import_is_declared(package: str) -> None:
    names = declared(package)
    missing = {
        module: where
        for module, where in imported(package).items()
        if DISTRIBUTION.get(module, module).replace("_", "-") not in names
        and PROVIDED.get(module) not in names
    }
    assert not missing, (
        f"packages/{package}/pyproject.toml does not declare what its source imports "
        f"(add a dependency, or an extra for an optional import): {missing}"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_patrl_dependencies_point_left(package: str) -> None:
    assert project(package)["name"] == f"patrl-{package}"
    patrl = {n.removeprefix("patrl-") for n in declared(package) if n.startswith("patrl-")}
    assert patrl <= ALLOWED_PATRL[package], patrl - ALLOWED_PATRL[package]


def test_meta_package_installs_exactly_the_six_from_this_checkout() -> None:
    deps = project(None)["dependencies"]
    assert sorted(requirement_name(d) for d in deps) == sorted(f"patrl-{p}" for p in PACKAGES)
    for dep in deps:
        name = requirement_name(dep).removeprefix("patrl-")
        assert dep.endswith(f"@ {{root:uri}}/packages/{name}"), dep
    assert sorted(p.name for p in (ROOT / "packages").iterdir() if p.is_dir()) == sorted(PACKAGES)


def test_the_examples_project_declares_its_imports_and_registers_the_demo() -> None:
    """examples/ (patrl-examples, the demo task) is not one of the six: the orchestrator finds
    its demo through the `patrl.assets` entry point it registers, never by import (the
    orchestrator declares no patrl-examples, so `test_every_import_is_declared` catches one)."""
    examples = tomllib.loads((ROOT / "examples" / "pyproject.toml").read_text())["project"]
    assert examples["name"] == "patrl-examples"
    names = {requirement_name(r) for r in examples["dependencies"]}
    missing = {
        module: where
        for module, where in imported("examples", ROOT / "examples" / "src").items()
        if module != "patrl_examples"
        and DISTRIBUTION.get(module, module).replace("_", "-") not in names
    }
    assert not missing, f"examples/pyproject.toml does not declare {missing}"
    target = examples["entry-points"]["patrl.assets"]["demo"]
    assert (ROOT / "examples" / "src" / (target.replace(".", "/") + ".py")).is_file(), target
    assert "patrl-examples" not in declared("orchestrator")
