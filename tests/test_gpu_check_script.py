"""benchmarks/gpu/check.sh, the one-shot device check, where it cannot run: without a CUDA
device it refuses before running or writing anything, and says so; without torch it names the
Python it tried."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
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


SUMMARIZE = SCRIPT.parent / "summarize.py"


def test_the_summary_names_each_failed_test_with_its_message_and_packs_the_logs(
    tmp_path: Path,
) -> None:
    # A real pytest run's JUnit XML, as check.sh's steps write it: one pass, one failure.
    out = tmp_path / "out"
    out.mkdir()
    case = tmp_path / "test_case.py"
    case.write_text(
        "def test_ok():\n    pass\n\n"
        "def test_bad():\n    assert 680 >= 760, 'greedy tokens agree on 680/768 positions'\n"
    )
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(case)]
    ran = subprocess.run(  # rootdir tmp_path: the case's id does not depend on where pytest runs
        [*run, f"--rootdir={tmp_path}", f"--junitxml={out / 'tests_x.xml'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    (out / "tests_x.log").write_text(ran.stdout)
    (out / "steps.txt").write_text(f"tests_x {ran.returncode} 3\nbench 0 5\n")
    done = subprocess.run(
        [sys.executable, str(SUMMARIZE), str(out), "--pack"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["passed"]
    tests, bench = summary["steps"]
    assert tests["tests"] == {"tests": 2, "failures": 1, "errors": 0, "skipped": 0}
    assert [f["test"] for f in tests["failed"]] == ["test_case::test_bad"]
    assert "agree on 680/768" in tests["failed"][0]["message"]
    assert bench == {"name": "bench", "exit_status": 0, "timed_out": False, "seconds": 5}
    assert "FAILED test_case::test_bad" in done.stdout and "680/768" in done.stdout
    # Packed: the logs, XML and steps.txt are in the archive and nowhere else.
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["steps.txt", "tests_x.log", "tests_x.xml"]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json"]


def test_the_decode_profile_runs_on_cpu_and_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    script = SCRIPT.parent / "decode_profile.py"
    args = ["--tiny", "--device", "cpu", "--backend", "sdpa", "--batches", "1,4", "--steps", "4"]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for row in rows:
        for mode in ("greedy", "seeded", "unseeded", "mixed"):
            assert row[mode]["tok_s"] > 0 and row[mode]["step_ms_median"] > 0
    assert "Self CPU time total" in done.stdout  # the profiler's table printed
