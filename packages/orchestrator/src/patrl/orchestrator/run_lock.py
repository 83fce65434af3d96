"""One job writes a run directory at a time: `<run_dir>/.patrl.lock`, held by the job's first
rank.

The lock names its holder (host, pid, torchrun run id) and is refreshed every few seconds by a
thread, so a second job can tell a live holder from a dead one on any host of a shared
filesystem: a lock not refreshed for `stale_s`, or held by a process that no longer exists on
this host, is stale and taken over (with a warning). A restart of the same torchrun job (same
run id) takes its own lock back at once.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from patrl.orchestrator.errors import JobError

LOCK_FILE = ".patrl.lock"
REFRESH_S = 5.0
STALE_S = 60.0


@dataclass(frozen=True, slots=True)
class Holder:
    host: str
    pid: int
    run_id: str  # torchrun's TORCHELASTIC_RUN_ID; "" for a plain process
    since: float  # time.time() at acquisition

    @classmethod
    def me(cls) -> Holder:
        return cls(
            socket.gethostname(),
            os.getpid(),
            os.environ.get("TORCHELASTIC_RUN_ID", ""),
            time.time(),
        )

    def describe(self) -> str:
        job = f", torchrun run id {self.run_id}" if self.run_id else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host}{job}, since {started}"


class RunDirLock:
    """Held while a job writes `run_dir`; `release` (or process exit) ends it."""

    def __init__(self, run_dir: Path, stale_s: float = STALE_S, refresh_s: float = REFRESH_S):
        self.path = Path(run_dir) / LOCK_FILE
        self.stale_s = stale_s
        self.refresh_s = refresh_s
        self.holder = Holder.me()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="patrl-run-lock", daemon=True)

    def acquire(self) -> RunDirLock:
        """Take the lock, or raise JobError naming the live holder and the ways out."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._create():
            other = self._read()
            if other is None:
                if self._unreadable_for(1.0):
                    self._write()  # left half-written by a crash: nobody holds it
                    break
                time.sleep(0.1)  # vanished, or being written right now: look again
                continue
            why = self._stale(other)
            if why is None:
                raise JobError(
                    f"run directory {self.path.parent} is being written by another job "
                    f"({other.describe()}; lock {self.path}). Stop that job, wait for it to "
                    "finish, or give this one another trainer.experiment_name"
                )
            print(
                f"patrl: warning: taking over the lock of {self.path.parent} from "
                f"{other.describe()}: {why}",
                file=sys.stderr,
                flush=True,
            )
            self._write()
            break
        self._thread.start()
        return self

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.refresh_s + 1)
        if self._read() == self.holder:
            self.path.unlink(missing_ok=True)

    def _stale(self, other: Holder) -> str | None:
        """Why `other`'s lock may be taken over, or None while it is live."""
        if other.run_id and other.run_id == self.holder.run_id:
            return "it is an earlier attempt of this torchrun job"
        if other.host == self.holder.host and not _alive(other.pid):
            return f"process {other.pid} no longer exists"
        age = time.time() - self.path.stat().st_mtime
        if age > self.stale_s:
            return f"its lock was last refreshed {age:.0f} s ago (stale after {self.stale_s:g} s)"
        return None

    def _unreadable_for(self, seconds: float) -> bool:
        try:
            return time.time() - self.path.stat().st_mtime > seconds
        except FileNotFoundError:
            return False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self.holder), f)
        return True

    def _write(self) -> None:
        staged = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}.new")
        staged.write_text(json.dumps(asdict(self.holder)))
        os.replace(staged, self.path)

    def _read(self) -> Holder | None:
        try:
            return Holder(**json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            if self._read() != self.holder:
                return  # taken over (we were presumed dead): the new holder owns it now
            os.utime(self.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
