"""The command line answers `--help` before importing torch, transformers or the loops."""

from __future__ import annotations

import json
import subprocess
import sys

# `python -m patrl.orchestrator --help`, then the heavy modules that got imported on the way.
HELP_THEN_MODULES = """
import json, runpy, sys
sys.argv = ["patrl", "--help"]
try:
    runpy.run_module("patrl.orchestrator", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    code = exit.code
heavy = ("torch", "transformers", "datasets", "patrl.trainer", "patrl.rollout")
print(json.dumps({"code": code, "heavy": sorted(m for m in heavy if m in sys.modules)}))
"""


def test_help_imports_no_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", HELP_THEN_MODULES], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    usage, _, last = done.stdout.rstrip().rpartition("\n")
    assert usage.startswith("usage: patrl") and "--dry-run" in usage
    assert json.loads(last) == {"code": 0, "heavy": []}
