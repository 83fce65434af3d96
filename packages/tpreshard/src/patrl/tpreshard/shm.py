"""Collectives among the ranks of one host through a shared-memory file (`ShmComm`).

Per collective round s = 1, 2, ... (one round per chunk of `slot_bytes`): each rank copies its
part into its own slot of buffer s % 2, then stores s in its flag; it waits until every flag of
the group is >= s, then reads the slots it needs. A rank that finished round s - 1 knows every
peer reached it, so no peer still reads buffer s % 2 from round s - 2: two buffers suffice.
Every rank adds the slots in rank order, so all ranks hold bit-identical sums. Flags are stored
after their data and loaded before it is read, which x86-64's total store order keeps in order
without fences; elsewhere `shm_supported()` is False. Waits poll instead of sleeping in the
kernel, because a small collective's cost is dominated by wake-up latency.
"""

from __future__ import annotations

import os
import pickle
import platform
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveTimeout", "ShmComm", "shm_supported"]

_FLAG_STRIDE = 8  # int64s per flag: one 64-byte cache line each, so flags never share a line
_SPIN_S = 0.002  # poll with sched_yield this long, then back off to short sleeps
# The longest of those sleeps bounds how late a rank that waited long (its replica ran dry)
# notices its round, a delay every rank's next round then shares: kept short, at the price
# of frequent wake-ups of an idle rank.
_MAX_SLEEP_S = 0.0001
_LIVENESS_EVERY_S = 0.1


class CollectiveTimeout(RuntimeError):
    """A shared-memory collective waited longer than its timeout, or a peer process died."""


def shm_supported() -> bool:
    """True where the lock-free protocol of this module is sound (x86-64, POSIX shared files)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.name == "posix"


def _shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class ShmComm:
    """All-reduce, all-gather and broadcast (tensors and pickled objects) among the ranks of
    `group`, all on this host, through one shared file; every rank of `group` must construct it.

    `slot_bytes` bounds one round; larger payloads go in chunks. A wait raises
    `CollectiveTimeout` after `timeout_s`, or sooner when a peer's process is gone. The file is
    unlinked once every rank has mapped it, so a crash leaves nothing in /dev/shm.

    `pid` is the process its peers watch for this rank (default: this one; a rank run by a
    stand-in names the process it stands for). `clock` (monotonic seconds) times the waits
    and `sleep` backs them off: a test passes a fake pair to step time instead of waiting."""

    def __init__(
        self,
        group: Any,
        *,
        slot_bytes: int = 4 << 20,
        timeout_s: float = 300.0,
        name: str = "tp",
        pid: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not shm_supported():
            raise RuntimeError(
                f"ShmComm needs x86-64 POSIX (total store order); this is {platform.machine()}"
            )
        if slot_bytes <= 0 or slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.name = name
        self.clock = clock
        self.sleep = sleep
        self.global_ranks = dist.get_process_group_ranks(group)
        flag_bytes = self.size * _FLAG_STRIDE * 8
        pid_bytes = self.size * 8
        total = flag_bytes + pid_bytes + 2 * self.size * slot_bytes
        box: list[Any] = [None]
        if self.rank == 0:
            path = _shm_dir() / f"patrl-{name}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            box[0] = (str(path), os.uname().nodename)
        dist.broadcast_object_list(box, group=group, group_src=0)
        path_str, host = box[0]
        if host != os.uname().nodename:
            raise RuntimeError(
                f"ShmComm({name}): rank {self.rank} runs on {os.uname().nodename!r}, the group's "
                f"first rank on {host!r}; a shared-memory group must be on one host"
            )
        try:
            mem = torch.from_file(path_str, shared=True, size=total, dtype=torch.uint8)
        finally:
            # every rank has mapped the file (or failed) before the first one unlinks it
            dist.barrier(group=group)
            if self.rank == 0:
                Path(path_str).unlink(missing_ok=True)
        self._mem = mem  # keeps the mapping alive
        self._flags = mem[:flag_bytes].view(torch.int64).view(self.size, _FLAG_STRIDE).numpy()
        pids = mem[flag_bytes : flag_bytes + pid_bytes].view(torch.int64).numpy()
        pids[self.rank] = os.getpid() if pid is None else pid
        self._pids = pids
        data = mem[flag_bytes + pid_bytes :]
        self._slots = data.view(2, self.size, slot_bytes)
        self._peers = [r for r in range(self.size) if r != self.rank]
        self._seq = 0
        # The flags start at 0 and the pids are written before this barrier, so the first
        # round cannot read a peer's stale flag or miss its pid.
        dist.barrier(group=group)
        self.rounds = 0

    # ---- the round ------------------------------------------------------------------------

    def _slot(self, parity: int, rank: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self._slots[parity, rank, :nbytes].view(dtype)

    def _round(self, post: Callable[[int], None]) -> int:
        """One round: `post(parity)` fills this rank's slot, then flag, then wait for all."""
        seq = self._seq + 1
        parity = seq & 1
        post(parity)
        self._flags[self.rank, 0] = seq
        self._wait(seq)
        self._seq = seq
        self.rounds += 1
        return parity

    def _wait(self, seq: int) -> None:
        flags = self._flags
        peers = self._peers
        if all(flags[r, 0] >= seq for r in peers):
            return
        start = self.clock()
        next_check = start + _LIVENESS_EVERY_S
        sleep = 0.0
        while True:
            if all(flags[r, 0] >= seq for r in peers):
                return
            now = self.clock()
            if now - start < _SPIN_S:
                os.sched_yield()
                continue
            sleep = min(_MAX_SLEEP_S, max(sleep * 2, 2e-5))
            self.sleep(sleep)
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                self._check_peers(seq, now - start)

    def _check_peers(self, seq: int, waited_s: float) -> None:
        missing = [r for r in self._peers if self._flags[r, 0] < seq]
        dead = [r for r in missing if not _alive(int(self._pids[r]))]
        if dead or waited_s > self.timeout_s:
            who = ", ".join(
                f"group rank {r} (global rank {self.global_ranks[r]}, pid {int(self._pids[r])}"
                f"{', process gone' if r in dead else ''})"
                for r in (dead or missing)
            )
            raise CollectiveTimeout(
                f"shared-memory collective on {self.name} group {self.global_ranks}: waited "
                f"{waited_s:.1f} s in round {seq} for {who}"
                + ("" if dead else f"; timeout_s={self.timeout_s}")
            )

    # ---- collectives ----------------------------------------------------------------------

    def _chunks(self, numel: int, itemsize: int) -> list[tuple[int, int]]:
        per = self.slot_bytes // itemsize
        return [(i, min(i + per, numel)) for i in range(0, max(numel, 1), per)]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group, in place (every rank gets the same bits); returns `t`."""
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        size = t.element_size()
        for lo, hi in self._chunks(flat.numel(), size):
            part = flat[lo:hi]
            nbytes = (hi - lo) * size

            def post(parity: int, part: torch.Tensor = part, nbytes: int = nbytes) -> None:
                self._slot(parity, self.rank, nbytes, t.dtype).copy_(part)

            parity = self._round(post)
            slots = [self._slot(parity, r, nbytes, t.dtype) for r in range(self.size)]
            torch.add(slots[0], slots[1], out=part)
            for s in slots[2:]:
                part.add_(s)
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view(t.shape))
        return t

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The group's tensors (same shape on every rank) concatenated along `dim`."""
        src = t.contiguous().view(-1)
        size = t.element_size()
        if src.numel() * size <= self.slot_bytes:
            nbytes = src.numel() * size

            def post(parity: int) -> None:
                self._slot(parity, self.rank, nbytes, t.dtype).copy_(src)

            parity = self._round(post)
            parts = [self._slot(parity, r, nbytes, t.dtype).view(t.shape) for r in range(self.size)]
            return torch.cat(parts, dim=dim)
        stacked = self.all_gather_into(torch.empty(self.size, *t.shape, dtype=t.dtype), t)
        return torch.cat(list(stacked.unbind(0)), dim=dim)

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The group's tensors stacked into `out` (contiguous, [group size, *t.shape]), in
        chunks of `slot_bytes`; returns `out`."""
        if tuple(out.shape) != (self.size, *t.shape) or out.dtype != t.dtype:
            raise ValueError(
                f"all_gather_into needs out of shape {(self.size, *t.shape)} and dtype "
                f"{t.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
        if not out.is_contiguous():
            raise ValueError("all_gather_into needs a contiguous out")
        src = t.contiguous().view(-1)
        dst = out.view(self.size, -1)
        size = t.element_size()
        for lo, hi in self._chunks(src.numel(), size):
            nbytes = (hi - lo) * size

            def post(parity: int, lo: int = lo, hi: int = hi, nbytes: int = nbytes) -> None:
                self._slot(parity, self.rank, nbytes, t.dtype).copy_(src[lo:hi])

            parity = self._round(post)
            for r in range(self.size):
                dst[r, lo:hi].copy_(self._slot(parity, r, nbytes, t.dtype))
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Group rank `src`'s `t` into `t` on every rank, in place; returns `t`."""
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        size = t.element_size()
        for lo, hi in self._chunks(flat.numel(), size):
            nbytes = (hi - lo) * size
            part = flat[lo:hi]

            def post(parity: int, part: torch.Tensor = part, nbytes: int = nbytes) -> None:
                if self.rank == src:
                    self._slot(parity, src, nbytes, t.dtype).copy_(part)

            parity = self._round(post)
            if self.rank != src:
                part.copy_(self._slot(parity, src, nbytes, t.dtype))
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view(t.shape))
        return t

    def all_gather_rows(self, t: torch.Tensor) -> Iterator[tuple[int, int, list[torch.Tensor]]]:
        """Every rank's 2-D contiguous `t` (the same shape everywhere), a block of whole rows
        at a time: yields (lo, hi, parts) with parts[r] rows [lo, hi) of rank r's tensor, views
        of the shared slots, valid until the next iteration (read them, do not keep them).
        The caller places each block where it belongs, without a gathered copy of the whole
        (the weight reshard's shrink). Every rank must run the iteration to its end."""
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"all_gather_rows needs a 2-D contiguous tensor, got {tuple(t.shape)}")
        rows, row_bytes = t.shape[0], t.shape[1] * t.element_size()
        if row_bytes > self.slot_bytes:
            raise ValueError(f"a row of {row_bytes} bytes exceeds slot_bytes={self.slot_bytes}")
        per = max(1, self.slot_bytes // max(row_bytes, 1))
        for lo in range(0, rows, per):
            hi = min(lo + per, rows)
            nbytes = (hi - lo) * row_bytes

            def post(parity: int, lo: int = lo, hi: int = hi, nbytes: int = nbytes) -> None:
                self._slot(parity, self.rank, nbytes, t.dtype).copy_(t[lo:hi].view(-1))

            parity = self._round(post)
            yield (
                lo,
                hi,
                [
                    self._slot(parity, r, nbytes, t.dtype).view(hi - lo, t.shape[1])
                    for r in range(self.size)
                ],
            )

    # ---- Python objects (control traffic: small, pickled) ------------------------------------

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in group-rank order: one round when every pickle fits
        a slot with its 8-byte length, chunked rounds for the rest of the longest otherwise."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head = self.slot_bytes - 8

        def post(parity: int) -> None:
            _post_bytes(self._slots[parity, self.rank], payload[:head], len(payload))

        parity = self._round(post)
        read = [_read_bytes(self._slots[parity, r]) for r in range(self.size)]
        sizes, parts = [size for size, _ in read], [part for _, part in read]
        rest = max(sizes) - head
        if rest > 0:
            tail = torch.zeros(rest, dtype=torch.uint8)
            if len(payload) > head:
                tail[: len(payload) - head] = torch.frombuffer(
                    bytearray(payload[head:]), dtype=torch.uint8
                )
            out = self.all_gather_into(torch.empty(self.size, rest, dtype=torch.uint8), tail)
            parts = [
                part + out[r, : max(size - head, 0)].numpy().tobytes()
                for r, (size, part) in enumerate(zip(sizes, parts, strict=True))
            ]
        return [pickle.loads(part) for part in parts]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Group rank `src`'s `obj` (picklable; ignored elsewhere), on every rank."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == src else b""
        head = self.slot_bytes - 8

        def post(parity: int) -> None:
            if self.rank == src:
                _post_bytes(self._slots[parity, src], payload[:head], len(payload))

        parity = self._round(post)
        size, part = _read_bytes(self._slots[parity, src])
        if size > head:
            tail = torch.zeros(size - head, dtype=torch.uint8)
            if self.rank == src:
                tail[:] = torch.frombuffer(bytearray(payload[head:]), dtype=torch.uint8)
            part += self.broadcast(tail, src=src).numpy().tobytes()
        return obj if self.rank == src else pickle.loads(part)

    def __repr__(self) -> str:
        return (
            f"ShmComm({self.name}, ranks={self.global_ranks}, slot_bytes={self.slot_bytes}, "
            f"rounds={self.rounds})"
        )


def _post_bytes(slot: torch.Tensor, data: bytes, total: int) -> None:
    """Into a slot: the payload's full length (int64), then its first bytes."""
    slot[:8].view(torch.int64)[0] = total
    if data:
        slot[8 : 8 + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _read_bytes(slot: torch.Tensor) -> tuple[int, bytes]:
    """From a slot: (the payload's full length, the bytes of it the slot holds)."""
    size = int(slot[:8].view(torch.int64)[0])
    return size, slot[8 : 8 + min(size, slot.numel() - 8)].numpy().tobytes()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not written yet: cannot tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped: its launcher is gone or slow) still answers kill(pid, 0);
    # its state in /proc is Z. Without procfs there is no telling.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return not os.path.exists("/proc/self/stat")
    except OSError:
        return True
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state != b"Z"
