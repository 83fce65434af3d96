"""benchmarks/gpu/check.sh, the one-shot device check, where it cannot run: without a CUDA
device it refuses before running or writing anything, and says so; without torch it names the
Python it tried."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="check.sh is a bash script")


def run_check(python: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PY": python, "OUT": str(out)}
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_a_cuda_device_it_refuses_and_runs_nothing(tmp_path: Path) -> None:
    done = run_check(sys.executable, tmp_path / "out")
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "nothing was run" in done.stderr
    assert not (tmp_path / "out").exists()


def test_without_torch_it_names_the_python(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-python-here")
    done = run_check(missing, tmp_path / "out")
    assert done.returncode == 3
    assert f"{missing} cannot import torch" in done.stderr
    assert not (tmp_path / "out").exists()
