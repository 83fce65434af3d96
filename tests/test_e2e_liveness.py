"""A job under torchrun whose rank freezes, whose agent is killed, that is stopped with Ctrl-C,
or that a second job tries to share a run directory with: each ends in bounded time, leaves no
rank behind, and says what happened in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from patrl_testkit.jobs import tiny_job_overrides
from patrl_testkit.processes import descendants, kill_tree

pytestmark = pytest.mark.multirank

JOB_TIMEOUT_S = 240.0  # a hang fails the test, not the CI job
HEARTBEAT_S = 8.0


def overrides(assets: Path, out: Path, **extra: Any) -> list[str]:
    return tiny_job_overrides(
        assets,
        out,
        **{
            "trainer.total_training_steps": 1000,  # never reached: every test stops the job
            "trainer.heartbeat_timeout_s": HEARTBEAT_S,
            **extra,
        },
    )


@contextmanager
def job(args: list[str], nproc: int = 2) -> Iterator[subprocess.Popen[str]]:
    """The job on `nproc` local ranks, in its own session; every process of it is gone after."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(nproc), "-m", "patrl.orchestrator", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        kill_tree(proc.pid)
        if proc.stdout is not None and not proc.stdout.closed:
            proc.communicate()


def wait_for(
    condition: Any,
    what: str,
    timeout_s: float = JOB_TIMEOUT_S,
    proc: subprocess.Popen[str] | None = None,
) -> None:
    """Poll `condition` until it holds; fail after `timeout_s`, or at once when `proc` (the
    job) has ended first, with the job's output in the message either way."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        ended = proc is not None and proc.poll() is not None
        if ended or time.monotonic() > deadline:
            output = ""
            if proc is not None:
                kill_tree(proc.pid)
                output, _ = proc.communicate()
            why = f"the job ended (exit {proc.returncode})" if ended and proc else "timed out"
            pytest.fail(f"{why} waiting for {what}; its output:\n{output[-4000:]}")
        time.sleep(0.2)


def trained_a_step(run_dir: Path) -> bool:
    """A complete checkpoint of any step is there. Not step 1's by name: older checkpoints
    are pruned (trainer.max_checkpoints_to_keep), and a poll that missed step 1's short life
    once waited for a job that then ran to its end."""
    return any(p.is_dir() and not p.name.endswith(".tmp") for p in run_dir.glob("global_step_*"))


def workers(agent: int) -> dict[int, int]:
    """rank -> pid of the agent's worker processes."""
    out = {}
    for pid in descendants(agent):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [e for e in env if e.startswith(b"RANK=")]
        if ranks and b"patrl.orchestrator" in Path(f"/proc/{pid}/cmdline").read_bytes():
            out[int(ranks[0][5:])] = pid
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def finish(proc: subprocess.Popen[str], timeout_s: float) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        pytest.fail(f"the job did not end within {timeout_s}s:\n{output[-4000:]}")
    return output


@pytest.mark.e2e
def test_a_frozen_rank_is_named_and_the_job_ends(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path
    with job(overrides(assets, tmp_path)) as proc:
        wait_for(lambda: trained_a_step(run_dir), "the first checkpoint", proc=proc)
        ranks = workers(proc.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGSTOP)
        frozen_at = time.monotonic()
        output = finish(proc, timeout_s=HEARTBEAT_S + 90)
        took = time.monotonic() - frozen_at
    assert proc.returncode != 0
    assert "patrl: rank 0: rank 1 has sent no heartbeat" in output, output[-3000:]
    assert took < HEARTBEAT_S + 90  # far below the 600 s collective timeout


@pytest.mark.e2e
def test_ranks_stop_when_their_agent_is_killed(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path
    with job(overrides(assets, tmp_path)) as proc:
        wait_for(lambda: trained_a_step(run_dir), "the first checkpoint", proc=proc)
        ranks = workers(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        wait_for(lambda: not any(alive(p) for p in ranks.values()), "the ranks to exit", 60)
        output, _ = proc.communicate()
    assert "torchrun agent" in output and "is gone" in output, output[-3000:]


@pytest.mark.e2e
def test_ctrl_c_prints_one_line_naming_the_checkpoint(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path
    with job(overrides(assets, tmp_path)) as proc:
        wait_for(lambda: trained_a_step(run_dir), "the first checkpoint", proc=proc)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        output = finish(proc, timeout_s=120)
    stopped = [line for line in output.splitlines() if line.startswith("patrl: ")]
    said = [line for line in output.splitlines() if line.startswith(("patrl", "[rank"))]
    assert len(stopped) == 1, said
    assert "the newest checkpoint is" in stopped[0] and "global_step_" in stopped[0]
    assert "KeyboardInterrupt" not in output, output[-3000:]


@pytest.mark.e2e
def test_a_second_job_on_the_same_run_dir_is_refused(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path
    with job(overrides(assets, tmp_path)) as proc:
        wait_for(lambda: trained_a_step(run_dir), "the first checkpoint", proc=proc)
        second = subprocess.run(
            # Not resuming: the first job's checkpoints are not what stops it.
            [
                sys.executable,
                "-m",
                "patrl.orchestrator",
                *overrides(assets, tmp_path, **{"trainer.resume_mode": "disable"}),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
        )
        assert proc.poll() is None  # the first job runs on
    assert second.returncode == 1
    assert "is being written by another job" in second.stderr
    assert f"pid {proc.pid}" not in second.stderr  # the holder is the rank, not the agent
    assert "Traceback" not in second.stderr
