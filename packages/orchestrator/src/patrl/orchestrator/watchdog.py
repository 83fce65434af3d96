"""Liveness of a multi-rank job, watched from a thread so that a rank stuck in a collective
still notices: peers that stop beating (frozen, SIGSTOPped, on a lost host) and the death of
this rank's torchrun agent.

Each rank's thread bumps its own counter in the job's store every `interval_s` and reads the
others'; a peer whose counter has not moved for `timeout_s` (on this rank's clock) is named and
this rank exits, which lets torchrun take the job down instead of every rank waiting out the
collective timeout. Under torchrun the thread also exits the rank when its parent, the agent,
is gone (killed): the rank would otherwise train and write checkpoints unsupervised.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_PREFIX = "patrl/heartbeat/"


class Watchdog:
    """Heartbeats of `rank` among `world_size` ranks on `store` (None: no peers to watch),
    and the parent watch. `exit` ends the process (os._exit by default: the main thread may be
    blocked in a collective)."""

    def __init__(
        self,
        store: Any | None,
        rank: int,
        world_size: int,
        timeout_s: float,
        watch_parent: bool,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval_s = min(max(timeout_s / 10, 0.2), 5.0)
        self.parent = os.getppid() if watch_parent else None
        self._exit = exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="patrl-watchdog", daemon=True)
        # peer -> (last counter value, when it last moved, on this rank's clock)
        self._seen: dict[int, tuple[int, float]] = {}

    def start(self) -> Watchdog:
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; peers stop watching this rank too (it says it is done)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 1)
        if self.store is not None:
            self.store.set(f"{_PREFIX}done/{self.rank}", "1")

    def _beat(self) -> None:
        if self.store is not None:
            self.store.add(f"{_PREFIX}{self.rank}", 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                why = self.check(time.monotonic())
                self._beat()
            except Exception as err:  # the store's host (an agent) is gone
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                why = self._orphaned() or f"the job's store is unreachable ({first})"
            if why is not None and not self._stop.is_set():
                print(f"patrl: rank {self.rank}: {why}; stopping", file=sys.stderr, flush=True)
                self._exit(1)
                return

    def _orphaned(self) -> str | None:
        if self.parent is not None and os.getppid() != self.parent:
            return (
                f"its torchrun agent (pid {self.parent}) is gone, so nothing supervises this "
                "rank any more"
            )
        return None

    def check(self, now: float) -> str | None:
        """Why this rank must stop now, or None: its agent is gone, or a peer went silent."""
        if (why := self._orphaned()) is not None:
            return why
        if self.store is None:
            return None
        for peer in range(self.world_size):
            if peer == self.rank or self.store.check([f"{_PREFIX}done/{peer}"]):
                continue
            count = int(self.store.add(f"{_PREFIX}{peer}", 0))
            last = self._seen.get(peer)
            if last is None or count != last[0]:
                self._seen[peer] = (count, now)
            elif now - last[1] > self.timeout_s:
                return (
                    f"rank {peer} has sent no heartbeat for {now - last[1]:.0f} s "
                    f"(trainer.heartbeat_timeout_s={self.timeout_s:g}): it is frozen (stopped, "
                    "swapping, deadlocked) or its host is unreachable"
                )
        return None


def start_watchdog(rank: int, world_size: int, timeout_s: float) -> Watchdog | None:
    """The job's watchdog on the default group's store; None for one process outside torchrun
    (nothing to watch). The parent is watched only under torchrun, whose agent is the parent of
    every rank it starts (a plain process's parent is a shell, which may come and go)."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if world_size < 2 and not under_torchrun:
        return None
    store = None
    if world_size > 1:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
    return Watchdog(store, rank, world_size, timeout_s, watch_parent=under_torchrun).start()
