"""The watchdog (a silent peer is named, the agent's death is noticed) and the run directory's
lock (a live holder refuses a second job by name; a dead or stale one is taken over)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from patrl.orchestrator.errors import JobError
from patrl.orchestrator.run_lock import LOCK_FILE, Holder, RunDirLock
from patrl.orchestrator.watchdog import Watchdog


class FakeStore:
    """The part of a c10d store the watchdog uses, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, int | str] = {}

    def add(self, key: str, by: int) -> int:
        value = int(self.values.get(key, 0)) + by
        self.values[key] = value
        return value

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


def test_a_peer_that_stops_beating_is_named_after_the_timeout() -> None:
    store = FakeStore()
    dog = Watchdog(store, rank=0, world_size=3, timeout_s=10.0, watch_parent=False)
    store.add("patrl/heartbeat/1", 1)
    store.add("patrl/heartbeat/2", 1)
    assert dog.check(now=0.0) is None
    store.add("patrl/heartbeat/1", 1)  # rank 1 beats, rank 2 is silent from here on
    assert dog.check(now=9.0) is None
    store.add("patrl/heartbeat/1", 1)
    why = dog.check(now=10.5)
    assert why is not None and why.startswith("rank 2 has sent no heartbeat for 10 s")
    assert "trainer.heartbeat_timeout_s=10" in why
    store.set("patrl/heartbeat/done/2", "1")  # a peer that finished is not missed
    store.add("patrl/heartbeat/1", 1)
    assert dog.check(now=30.0) is None


def test_the_thread_exits_the_rank_and_says_why(capfd: pytest.CaptureFixture[str]) -> None:
    store = FakeStore()
    exits: list[int] = []
    dog = Watchdog(store, 1, 2, timeout_s=0.5, watch_parent=False, exit=exits.append).start()
    deadline = time.monotonic() + 20
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert exits == [1]
    err = capfd.readouterr().err
    assert "patrl: rank 1: rank 0 has sent no heartbeat" in err and err.rstrip().endswith(
        "stopping"
    )
    assert store.values["patrl/heartbeat/done/1"] == "1"


def test_the_agents_death_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The parent is faked from the start: a test process may itself be an orphan (parent 1, as
    # under a detached shell), where the real getppid would never change.
    monkeypatch.setattr(os, "getppid", lambda: 4242)
    dog = Watchdog(None, 0, 1, timeout_s=5.0, watch_parent=True)
    assert dog.check(now=0.0) is None
    monkeypatch.setattr(os, "getppid", lambda: 1)  # re-parented: the agent is gone
    why = dog.check(now=1.0)
    assert why is not None and "torchrun agent" in why and "is gone" in why


def test_a_live_holder_is_refused_by_name_and_released(tmp_path: Path) -> None:
    first = RunDirLock(tmp_path / "run").acquire()
    with pytest.raises(JobError, match=r"being written by another job \(pid \d+ on host") as err:
        RunDirLock(tmp_path / "run").acquire()
    assert "trainer.experiment_name" in str(err.value)
    first.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    RunDirLock(tmp_path / "run").acquire().release()


def _write_holder(path: Path, holder: Holder) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"host": holder.host, "pid": holder.pid, "run_id": holder.run_id, "since": holder.since}
        )
    )


def test_dead_stale_and_own_restart_locks_are_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    me = Holder.me()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    path = tmp_path / "a" / LOCK_FILE
    _write_holder(path, Holder(me.host, int(dead.stdout), "", time.time()))
    RunDirLock(path.parent).acquire().release()
    assert "no longer exists" in capfd.readouterr().err

    path = tmp_path / "b" / LOCK_FILE
    _write_holder(path, Holder("another-host", 1, "", time.time()))
    with pytest.raises(JobError, match="another-host"):
        RunDirLock(path.parent).acquire()
    old = time.time() - 3600
    os.utime(path, (old, old))
    RunDirLock(path.parent).acquire().release()
    assert "last refreshed" in capfd.readouterr().err

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    path = tmp_path / "c" / LOCK_FILE
    _write_holder(path, Holder("another-host", 1, "job-7", time.time()))
    lock = RunDirLock(path.parent).acquire()
    assert "earlier attempt of this torchrun job" in capfd.readouterr().err
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()


def test_the_holder_refreshes_its_lock(tmp_path: Path) -> None:
    lock = RunDirLock(tmp_path, stale_s=60, refresh_s=0.1).acquire()
    path = tmp_path / LOCK_FILE
    old = time.time() - 3600
    os.utime(path, (old, old))
    deadline = time.monotonic() + 20
    while path.stat().st_mtime < time.time() - 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.stat().st_mtime > time.time() - 60
    lock.release()


def test_a_run_that_fails_before_writing_leaves_no_empty_run_dir(tmp_path: Path) -> None:
    """The lock makes the run dir (and its missing parents); a run that fails before writing
    anything leaves none of them behind, while a directory that existed, or holds what a run
    wrote, stays."""
    import torch

    from patrl.orchestrator.config import load_config
    from patrl.orchestrator.distributed import World
    from patrl.orchestrator.main import run_dir_lock

    world = World(0, 1, 0, torch.device("cpu"))
    run_dir = tmp_path / "runs" / "project" / "run"
    config = load_config(None, [f"trainer.default_local_dir={run_dir}"])
    with pytest.raises(RuntimeError, match="failed early"), run_dir_lock(config, world):
        assert (run_dir / LOCK_FILE).is_file()
        raise RuntimeError("failed early")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError), run_dir_lock(config, world):
        (run_dir / "metrics.jsonl").write_text("{}\n")
        raise RuntimeError("failed after a step")
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
    (run_dir / "metrics.jsonl").unlink()
    with pytest.raises(RuntimeError), run_dir_lock(config, world):
        raise RuntimeError("failed early, in a run dir that was there")
    assert run_dir.is_dir()  # it existed before this run
