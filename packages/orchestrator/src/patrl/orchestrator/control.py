"""The async schedule's control plane: small keys in the job's store, never a collective.

Rollout and trainer ranks run at their own pace, so they poll store keys (counters, values,
presence) instead of meeting in collectives; every wait has a deadline and names the rank it
waited on. Liveness is a heartbeat counter per rank watched on the observer's own clock, and a
waiter may also require progress (a second counter bumped only for work done). Lost rollout
ranks' work is handed on by the store's atomic `claim` and `put_first`. See docs/async.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

_BEAT_EVERY_S = 0.5
_STATUS = "status"  # "done", or "failed: <who and why>"


class PeerFailed(RuntimeError):
    """A peer reported a failure, stopped beating, or a wait ran past its deadline."""


class ControlPlane:
    """Keys under `prefix` in `store`; `timeout_s` bounds every wait on a peer. `clock` (seconds,
    monotonic) times heartbeats and waits and `sleep` paces polling: a test passes a fake pair
    to step time instead of waiting it out."""

    def __init__(
        self,
        store: Any,
        rank: int,
        timeout_s: float,
        prefix: str = "async/",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.store = store
        self.rank = rank
        self.timeout_s = timeout_s
        self.prefix = prefix
        self.clock = clock
        self.sleep = sleep
        self._last_beat = -float("inf")
        # (counter name, peer) -> (value, when it last moved, on this rank's clock)
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}
        self._last_progress = -float("inf")

    @classmethod
    def of_default_group(cls, rank: int, timeout_s: float) -> ControlPlane:
        """On the store `init_process_group` rendezvoused on."""
        return cls(dist.distributed_c10d._get_default_store(), rank, timeout_s)

    # ------------------------------------------------------------ values

    def _key(self, name: str) -> str:
        return self.prefix + name

    def counter(self, name: str) -> int:
        return int(self.store.add(self._key(name), 0))

    def bump(self, name: str, by: int = 1) -> int:
        """Add `by` to a counter (created at 0); the new value."""
        return int(self.store.add(self._key(name), by))

    def put(self, name: str, value: bytes | str) -> None:
        self.store.set(self._key(name), value)

    def has(self, names: Iterable[str]) -> bool:
        return bool(self.store.check([self._key(n) for n in names]))

    def get(self, name: str) -> bytes:
        return bytes(self.store.get(self._key(name)))

    def delete(self, name: str) -> None:
        self.store.delete_key(self._key(name))

    def put_first(self, name: str, value: bytes) -> bool:
        """Set `name` only if it is absent (or empty); whether this call's value is the one
        stored. An empty `value` could be overwritten, so it is refused."""
        if not value:
            raise ValueError(f"put_first({name!r}) needs a non-empty value")
        return bytes(self.store.compare_set(self._key(name), "", value)) == value

    def claim(self, name: str) -> bool:
        """True for exactly one caller per `name`, over the whole job."""
        return self.bump(f"claim/{name}") == 1

    # ------------------------------------------------------------ preemption

    def preempt(self, rank: int, down_s: float) -> None:
        """Reclaim rollout rank `rank` (a spot instance taken back): it drops its work at its
        next engine step, which its peers continue, and stays away for `down_s` seconds (or
        until `resume(rank)`), then rejoins with the newest weights."""
        if not down_s >= 0:
            raise ValueError(f"down_s must be >= 0 seconds, got {down_s}")
        self.put(f"preempt/{rank}", str(down_s))

    def resume(self, rank: int) -> None:
        """End a preempted rank's down time now."""
        self.put(f"resume/{rank}", "1")

    # -------------------------------------------------- liveness, shutdown

    def beat(self, now: bool = False) -> None:
        """Tell the others this rank is alive (rate-limited: cheap to call every loop; `now`
        beats regardless)."""
        t = self.clock()
        if now or t - self._last_beat >= _BEAT_EVERY_S:
            self.bump(f"beat/{self.rank}")
            self._last_beat = t

    def progress(self) -> None:
        """Tell the others this rank did work (rate-limited like `beat`)."""
        now = self.clock()
        if now - self._last_progress >= _BEAT_EVERY_S:
            self.bump(f"progress/{self.rank}")
            self._last_progress = now

    def finish(self) -> None:
        self.put(_STATUS, "done")

    def fail(self, why: str) -> None:
        """Tell the others this rank failed, so they stop at once instead of at a timeout.
        The first failure is kept: it is the cause, later ones are its consequences."""
        if not self.has([_STATUS]):
            self.put(_STATUS, f"failed: rank {self.rank}: {why}")

    def done(self) -> bool:
        """True once the run finished; raises PeerFailed if a peer reported a failure."""
        if not self.has([_STATUS]):
            return False
        status = self.get(_STATUS).decode()
        if status.startswith("failed"):
            raise PeerFailed(f"rank {self.rank} stops: a peer {status}")
        return True

    def check_alive(self, peers: Iterable[int]) -> None:
        """Raise PeerFailed naming every peer whose heartbeat has not moved for timeout_s."""
        stale = self._stale("beat", peers)
        if stale:
            raise PeerFailed(
                f"rank {self.rank}: ranks {stale} sent no heartbeat for {self.timeout_s:.0f} s "
                "(dead or stalled)"
            )

    def check_any_alive(self, peers: Iterable[int]) -> None:
        """Raise PeerFailed when every one of `peers` (interchangeable ones: some may be lost)
        has not beaten for timeout_s."""
        peers = list(peers)
        if self._all_stale("beat", peers):
            raise PeerFailed(
                f"rank {self.rank}: all of ranks {peers} sent no heartbeat for "
                f"{self.timeout_s:.0f} s (dead, stalled or preempted): nobody is left to wait on"
            )

    def stale_peers(self, peers: Iterable[int]) -> list[int]:
        """Peers whose heartbeat has not moved for timeout_s, as this rank has watched them
        (the clock starts at the first look)."""
        return self._stale("beat", peers)

    def check_progress(self, peers: Iterable[int], what: str) -> None:
        """Raise PeerFailed if none of `peers` reported progress for timeout_s."""
        peers = list(peers)
        if self._all_stale("progress", peers):
            raise PeerFailed(
                f"rank {self.rank}: ranks {peers} are alive but did no work for "
                f"{self.timeout_s:.0f} s while this rank waits for {what}: their control state "
                "says there is nothing to do (a bug, or keys of an earlier attempt in the store)"
            )

    def _all_stale(self, name: str, peers: list[int]) -> bool:
        """Whether `peers` is not empty and none of them moved counter `name` for timeout_s."""
        return bool(peers) and self._stale(name, peers) == peers

    def _stale(self, name: str, peers: Iterable[int]) -> list[int]:
        """Peers whose counter `name` has not moved for timeout_s (clock starts at first look)."""
        now = self.clock()
        stale = []
        for peer in peers:
            value = self.counter(f"{name}/{peer}")
            last = self._seen.get((name, peer))
            if last is None or last[0] != value:
                self._seen[(name, peer)] = (value, now)
            elif now - last[1] > self.timeout_s:
                stale.append(peer)
        return stale

    def wait_until(
        self,
        ready: Callable[[], bool],
        what: str,
        peers: Iterable[int],
        poll_s: float = 0.005,
        need_progress: bool = False,
        any_peer: bool = False,
    ) -> float:
        """Poll `ready` until true; seconds waited. Fails if the run failed, or if `peers`
        (the ranks that would make it true) stop beating (with `any_peer`: all of them, any
        one can make it true), or, with `need_progress`, all stop working. This rank keeps
        beating meanwhile."""
        peers = list(peers)
        start = self.clock()
        while not ready():
            self.beat()
            if self.done():
                raise PeerFailed(f"rank {self.rank}: the run ended while waiting for {what}")
            if any_peer:
                self.check_any_alive(peers)
            else:
                self.check_alive(peers)
            if need_progress:
                self.check_progress(peers, what)
            self.sleep(poll_s)
        return self.clock() - start
