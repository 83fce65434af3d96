"""Developer sessions: `nox -s tests`, `install_check`, `lint`, `typecheck`, `bench`, `demo`,
`gpu`, `tests_floor` (the lowest declared transformers), and `wheels` (the wheelhouse that
installs any one package from this checkout).

The sessions that run code install the six packages and the examples project (examples/: the
demo task the main job and the tests' kit use); `install_check` installs packages without it.

Every session installs the pinned CPU torch first: an unpinned torch would pull several GB of
CUDA packages, and the packages' own `torch>=2.6` range is then satisfied by what is there.
Virtualenvs are reused, so a second `nox -s tests` only re-checks the installs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nox

nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "install_check", "lint", "typecheck"]

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"
# Order matters only for readability: pip resolves them together, the local ones first.
PACKAGES = ["kvstore", "tpreshard", "lenpredict", "rollout", "trainer", "orchestrator"]
# Not one of the packages: patrl_examples (the demo task), found by the orchestrator through
# its `patrl.assets` entry point.
EXAMPLES = "examples"
# Triton runs the GPU paged-attention kernels' tests on CPU through its interpreter
# (TRITON_INTERPRET=1); its wheels exist for Linux x86-64 only, elsewhere those tests skip.
TRITON = "triton>=3.2; platform_system == 'Linux' and platform_machine == 'x86_64'"
TOMLI = "tomli>=2; python_version < '3.11'"  # tests/test_packaging.py reads the pyprojects
# peft: the LoRA tests hold patrl's adapters to PEFT's math and files (patrl does not import it).
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "peft==0.21.2", TRITON, TOMLI]


def install_patrl(session: nox.Session, *extra: str) -> None:
    session.install(TORCH)
    editable: list[str] = []
    for name in PACKAGES:
        editable += ["-e", f"packages/{name}"]
    session.install(*editable, "-e", EXAMPLES, *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """All package tests and the cross-package tests in tests/."""
    install_patrl(session, *TEST_DEPS)
    # One thread per process: multi-rank tests put several ranks on two cores.
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    session.run("pytest", *session.posargs, env=env)


def build_wheelhouse(session: nox.Session, out: Path) -> Path:
    """The six packages' wheels in `out`, and `out/constraints.txt` naming each one by its file
    URL: `pip install -c out/constraints.txt patrl-<name>` then takes every patrl package from
    `out` (a constraint with a URL admits nothing else, so no same-named index package either)
    and everything else from the index. Returns the constraints file."""
    session.install("hatchling>=1.21")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("patrl_*.whl"):
        old.unlink()
    sources = [str(ROOT / "packages" / name) for name in PACKAGES]
    session.run(
        "python", "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
        *sources,
    )  # fmt: skip
    pins = []
    for wheel in sorted(out.glob("patrl_*.whl")):
        name = wheel.name.split("-")[0].replace("_", "-")
        pins.append(f"{name} @ {wheel.resolve().as_uri()}\n")
    if len(pins) != len(PACKAGES):
        session.error(f"expected {len(PACKAGES)} patrl wheels in {out}, found {len(pins)}")
    constraints = out / "constraints.txt"
    constraints.write_text("".join(pins))
    return constraints


@nox.session
def wheels(session: nox.Session) -> None:
    """dist/: the six wheels and dist/constraints.txt; then any one package installs alone with
    `pip install -c dist/constraints.txt patrl-rollout` (README, Packages)."""
    constraints = build_wheelhouse(session, ROOT / "dist")
    session.log(f"pip install -c {constraints.relative_to(ROOT)} patrl-<name>")


# Run in each fresh virtualenv after the install: the package imports; exactly the expected
# patrl distributions are there, each from the wheelhouse; torch is or is not installed.
_CHECK_INSTALL = """
import importlib, importlib.metadata as md, importlib.util, json, sys
package, wheelhouse, expected, torch_expected = sys.argv[1:]
importlib.import_module(package.replace("-", "."))
dists = {d.metadata["Name"]: d for d in md.distributions() if d.metadata["Name"].startswith("patrl")}
assert sorted(dists) == sorted(expected.split(",")), sorted(dists)
for name, dist in dists.items():
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    assert url.startswith(wheelhouse), f"{name} came from {url or 'an index'}, not {wheelhouse}"
has_torch = importlib.util.find_spec("torch") is not None
assert has_torch == (torch_expected == "torch"), f"torch installed: {has_torch}"
print(f"{package}: imports; {', '.join(sorted(dists))} from the wheelhouse; torch: {has_torch}")
"""

# Run in the orchestrator's virtualenv (no examples project there): the default job, which asks
# for the demo task, is refused before any work, naming how to install it.
_CHECK_NO_DEMO = """
import subprocess, sys
run = subprocess.run([sys.executable, "-m", "patrl.orchestrator", "--dry-run"], capture_output=True, text=True)
assert run.returncode == 2 and "pip install -e examples" in run.stderr, (run.returncode, run.stderr)
print("patrl-orchestrator without patrl-examples: the default job is refused, naming `pip install -e examples`")
"""

# A higher-versioned `patrl-lenpredict` with no code: a same-named package on an index, which
# pip would prefer to the checkout's 0.1.0 without the wheelhouse's constraints.
_DECOY = """
[build-system]
requires = ["hatchling>=1.21"]
build-backend = "hatchling.build"
[project]
name = "patrl-lenpredict"
version = "99.0"
[tool.hatch.build.targets.wheel]
bypass-selection = true
"""

# package -> (what it must bring along, whether torch comes with it)
_ALONE = {
    "patrl-lenpredict": (["patrl-lenpredict"], False),
    "patrl-rollout": (
        ["patrl-rollout", "patrl-kvstore", "patrl-tpreshard", "patrl-lenpredict"],
        True,
    ),
    # The library without the examples project (the demo task is found, not imported).
    "patrl-orchestrator": (["patrl-" + name for name in PACKAGES], True),
}


@nox.session
def install_check(session: nox.Session) -> None:
    """patrl-lenpredict, patrl-rollout and patrl-orchestrator, each alone, into a fresh
    virtualenv from the wheelhouse, the way the README's Packages section says: each imports,
    its patrl dependencies come from this checkout even with a higher-versioned same-named
    package on offer, the orchestrator comes without patrl-examples (and refuses the default
    job, which asks for its demo task, saying how to install it), and lenpredict brings no
    torch (rollout and orchestrator get the pinned CPU torch, as every session does)."""
    tmp = Path(session.create_tmp())
    constraints = build_wheelhouse(session, tmp / "wheels")
    wheelhouse = (tmp / "wheels").resolve().as_uri()
    check = tmp / "check_install.py"
    check.write_text(_CHECK_INSTALL)
    decoy = tmp / "decoy"
    (decoy / "src").mkdir(parents=True, exist_ok=True)
    (decoy / "src" / "pyproject.toml").write_text(_DECOY)
    session.run(
        "python", "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", str(decoy), str(decoy / "src"),
    )  # fmt: skip
    for package, (expected, with_torch) in _ALONE.items():
        venv = tmp / package
        session.run("python", "-m", "venv", "--clear", str(venv))
        python = str(venv / "bin" / "python")
        pinned = [TORCH] if with_torch else []
        # No byte-compiling of torch's files: the check imports a few modules once.
        session.run(
            python, "-m", "pip", "install", "-q", "--no-compile", "-c", str(constraints),
            "--find-links", str(decoy), *pinned, package,
            external=True,
        )  # fmt: skip
        session.run(
            python, str(check), package, wheelhouse, ",".join(expected),
            "torch" if with_torch else "no torch",
            external=True,
        )  # fmt: skip
        if package == "patrl-orchestrator":
            session.run(python, "-c", _CHECK_NO_DEMO, external=True)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources and the examples project's."""
    install_patrl(session, "mypy>=1.10")
    session.run(
        "mypy", *[f"packages/{name}/src" for name in PACKAGES], f"{EXAMPLES}/src/patrl_examples"
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark in benchmarks/; each writes JSON under benchmarks/results/."""
    install_patrl(session)
    scripts = sorted((ROOT / "benchmarks").glob("*_bench.py"))
    wanted = set(session.posargs)
    for script in scripts:
        if wanted and script.stem not in wanted:
            continue
        session.run("python", str(script.relative_to(ROOT)))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: GRPO with adaptive TP on the embedded model and dataset, 2 ranks."""
    install_patrl(session)
    example = ROOT / "examples" / "grpo_adaptive_tp.py"
    if not example.exists():
        session.error(
            "examples/grpo_adaptive_tp.py does not exist yet: it arrives with the orchestrator "
            "issue. Until then `nox -s tests` is the thing to run."
        )
    session.run("torchrun", "--nproc_per_node", "2", str(example), *session.posargs)


@nox.session
def demo_tools(session: nox.Session) -> None:
    """The tool demo: GRPO with multi-turn calculator rollouts on the embedded task, 2 ranks."""
    install_patrl(session)
    example = ROOT / "examples" / "grpo_tools.py"
    session.run("torchrun", "--nproc_per_node", "2", str(example), *session.posargs)


@nox.session
def demo_tools_long_sums(session: nox.Session) -> None:
    """The tool demo on long sums, where calling the calculator pays: 2 ranks."""
    install_patrl(session)
    example = ROOT / "examples" / "grpo_tools.py"
    session.run(
        "torchrun", "--nproc_per_node", "2", str(example), "--task", "long_sums", *session.posargs
    )


@nox.session
def gpu(session: nox.Session) -> None:
    """CUDA-only tests (flash backend, CUDA parity); skipped cleanly on a CPU machine."""
    install_patrl(session, *TEST_DEPS)
    has_cuda = session.run(
        "python", "-c", "import torch; print(torch.cuda.is_available())", silent=True
    )
    if "True" not in str(has_cuda):
        session.skip("no CUDA device here")
    session.run("pytest", "-m", "gpu", *session.posargs)


def declared_floor(requirement: str) -> str:
    """The highest `<requirement>>=X` lower bound the packages' pyprojects declare: the oldest
    version every package that names it claims to support."""
    floors = []
    for name in PACKAGES:
        text = (ROOT / "packages" / name / "pyproject.toml").read_text()
        floors += re.findall(rf'"{re.escape(requirement)}>=([0-9][0-9.]*)', text)
    if not floors:
        raise ValueError(f"no package declares a {requirement}>= floor")
    return max(floors, key=lambda v: tuple(int(p) for p in v.split(".")))


@nox.session
def tests_floor(session: nox.Session) -> None:
    """The trainer's tests (and any given as arguments) against the lowest transformers the
    packages declare, so the floor is a version that works. Not a default session: it
    downloads that transformers and its dependencies into its own virtualenv."""
    floor = declared_floor("transformers")
    install_patrl(session, *TEST_DEPS, f"transformers=={floor}")
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    session.run(
        "python", "-c", "import transformers; print('transformers', transformers.__version__)"
    )
    session.run("pytest", *(session.posargs or ["packages/trainer/tests"]), env=env)
