"""patrl imports where only the GPU machine's packages are (`/work/shared/device/README.md`,
benchmarks/gpu/check.sh): torch, triton, transformers, safetensors, numpy, pytest, tqdm,
pyarrow, hypothesis and what they pull in, plus the wheels check.sh unpacks (pydantic and its
parts, math-verify and its parts). No `datasets`, no flash-attn. In a fresh process whose
import system finds nothing else, every public module of every package imports, so do the test
modules check.sh runs there, and a local .jsonl and .parquet dataset load."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

# The distributions that machine has (besides the standard library), each with the
# dependencies it declares: what is installed here of them stands for what it has there.
GPU_MACHINE = [
    "torch", "triton", "transformers", "safetensors", "numpy", "pytest", "pytest-timeout",
    "tqdm", "pyarrow", "hypothesis",
    # the wheels check.sh unpacks
    "pydantic", "math-verify",
]  # fmt: skip


def with_dependencies(roots: list[str]) -> set[str]:
    """`roots` and every distribution they require (extras left out), as installed here."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here (a platform's own dependency)
        seen.add(name)
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def top_level_modules(distributions: set[str]) -> set[str]:
    """The top-level modules and packages the installed `distributions` provide."""
    modules: set[str] = set()
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in distributions:
            continue
        listed = dist.read_text("top_level.txt")
        if listed:
            modules.update(listed.split())
        for file in dist.files or []:
            top = file.parts[0]
            if top.endswith((".dist-info", ".data", "..")) or top == "__pycache__":
                continue
            modules.add(top.split(".")[0])
    return modules


SCRIPT = r"""
import importlib, importlib.abc, importlib.util, json, sys
from pathlib import Path

allowed = set(sys.stdlib_module_names) | set(json.loads(sys.argv[1])) | {"patrl", "patrl_examples"}
blocked = set()


class Hide(importlib.abc.MetaPathFinder):
    '''The finder it wraps, blind to every top-level module not in `allowed`.'''

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in allowed and not top.startswith("_sysconfigdata"):  # stdlib's own
            blocked.add(top)
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):  # package metadata: what is installed
        return getattr(self.finder, "find_distributions", lambda *a, **k: [])(*args, **kwargs)

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
failed = {}
modules = []
src = Path(sys.argv[2])
for path in sorted([*src.glob("packages/*/src/patrl/*/**/*.py"), *src.glob("examples/src/*/**/*.py")]):
    parts = path.with_suffix("").parts
    parts = parts[parts.index("src") + 1 :]
    if any(p.startswith("_") and p != "__init__" for p in parts):
        continue
    name = ".".join(parts).removesuffix(".__init__")
    modules.append(name)
    try:
        importlib.import_module(name)
    except Exception as err:
        failed[name] = f"{type(err).__name__}: {err}"

# The test modules check.sh runs there (those holding gpu-marked tests) import too.
root = Path(sys.argv[2])
test_dirs = [root / "tests", *root.glob("packages/*/tests")]
sys.path[:0] = [str(d) for d in test_dirs]
allowed.update(p.stem for d in test_dirs for p in d.iterdir())  # the testkits: this repo's own
for path in sorted([*root.glob("packages/*/tests/test_*.py"), *root.glob("tests/test_*.py")]):
    if "pytest.mark.gpu" not in path.read_text():
        continue
    modules.append(path.name)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except BaseException as err:  # pytest's skips and failures are BaseExceptions
        failed[path.name] = f"{type(err).__name__}: {err}"

from patrl.orchestrator.data import read_rows

tmp = Path(sys.argv[3])
(tmp / "rows.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"}\n')
import pyarrow as pa, pyarrow.parquet as pq

pq.write_table(pa.Table.from_pylist([{"prompt": "3+3", "answer": "6"}]), tmp / "rows.parquet")
rows = read_rows([str(tmp / "rows.jsonl"), str(tmp / "rows.parquet")])
print(json.dumps({"modules": modules, "failed": failed, "rows": rows, "blocked": sorted(blocked),
                  "datasets_loaded": "datasets" in sys.modules}))
"""


def test_every_package_imports_and_reads_local_data_with_the_gpu_machines_packages(
    tmp_path: Path,
) -> None:
    allowed = sorted(top_level_modules(with_dependencies(GPU_MACHINE)))
    assert {"torch", "transformers", "pydantic", "math_verify"} <= set(allowed)
    assert "datasets" not in allowed
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(allowed), str(ROOT), str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["modules"]) > 50
    failures = "\n".join(f"{k}: {v}" for k, v in result["failed"].items())
    assert not failures, f"{failures}\nnot found along the way: {result['blocked']}"
    assert not result["datasets_loaded"]
    assert result["rows"] == [
        {"prompt": "1+1", "answer": "2"},
        {"prompt": "2+2", "answer": None},
        {"prompt": "3+3", "answer": "6"},
    ]
