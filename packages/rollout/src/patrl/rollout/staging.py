"""One host-to-device copy per step: a step's host-built index arrays packed into one buffer.

A forward needs a handful of small index tensors built on the host (token ids, positions,
cumulative lengths, KV slots, block tables, the rows to sample). Moved one by one, each costs
a pinned allocation and a copy call on the host. `StepStaging` writes them into ONE persistent
host buffer (pinned on CUDA) and moves that with ONE copy into one fresh device buffer, of
which every tensor is a view, each at a 16-byte aligned offset.

A non-blocking copy from pinned memory reads the host buffer after the host has moved on, so a
buffer is not written again until that copy is done: `StepStaging` alternates between two host
buffers and, before writing one, waits on the CUDA event recorded after the copy that last read
it (two stages ago: in a steady decode loop, long done). The device buffer is fresh each stage
(the caching allocator keeps its reuse stream-ordered), so a tensor of one stage stays valid
however many stages follow. The wait costs nothing in a steady decode loop (the event is two
stages old, and the step's copy of its results back to the host has synchronised since); a
loop that staged steps ahead of their syncs would block there. On CPU the same code runs with
`HostCopies`: a plain host buffer,
a real copy, no events; it differs from `CudaCopies` only in those runtime calls.

Every host-to-device copy of a step goes through `move`, so a test can count them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ALIGN = 16
"""Every staged array starts at a multiple of 16 bytes of the buffer: int64 and int32 views of
one byte buffer need their element size, and kernels (triton) specialise on 16-byte aligned
pointers, as a tensor of its own would be."""

_NUMPY: dict[torch.dtype, type] = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.bool: np.bool_,
}

Filler = Callable[[np.ndarray], None]


@dataclass(frozen=True, slots=True)
class Array:
    """One array to stage, of `dtype` and `shape` (None: [len(values)]): `values` is what
    numpy assigns to an array of that shape (a flat or nested sequence, a numpy array), or a
    function that writes the whole destination (a numpy view of the host buffer, of that shape
    and dtype, holding garbage) itself."""

    values: Sequence[Any] | np.ndarray | Filler
    dtype: torch.dtype
    shape: tuple[int, ...] | None = None

    def resolved_shape(self) -> tuple[int, ...]:
        if self.shape is not None:
            return self.shape
        if callable(self.values):
            raise ValueError("an Array filled by a function needs its shape")
        return (len(self.values),)


def layout(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of arrays of (shape, dtype) packed in order, each ALIGN-aligned, and the
    bytes they take in all. The same specs always give the same offsets (CUDA graphs capture
    views at them)."""
    offsets = []
    end = 0
    for shape, dtype in specs:
        if dtype not in _NUMPY:
            raise TypeError(f"cannot stage {dtype}: stageable dtypes are {list(_NUMPY)}")
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + _numel(shape) * dtype.itemsize
    return offsets, end


def views(
    buffer: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]
) -> list[torch.Tensor]:
    """Tensors of (shape, dtype) at `layout(specs)`'s offsets of the uint8 `buffer` (a
    multiple of ALIGN bytes long): one reinterpretation of the buffer per dtype, then a slice
    (and a reshape when not 1-D) per array, to keep a step's torch calls few."""
    offsets, _ = layout(specs)
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for (shape, dtype), start in zip(specs, offsets, strict=True):
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buffer.view(dtype)
        first = start // dtype.itemsize
        t = whole[first : first + _numel(shape)]
        out.append(t if len(shape) == 1 else t.view(shape))
    return out


def move(src: torch.Tensor, device: torch.device, *, copy: bool = False) -> torch.Tensor:
    """`src` (host memory) on `device`: a non-blocking copy, which on CUDA returns at once when
    `src` is pinned. Every host-to-device copy of a step goes through here (tests count the
    calls). On CPU the host is the device: `src` itself, or a copy with `copy`."""
    return src.to(device, non_blocking=True, copy=copy)


class CudaCopies:
    """The CUDA calls behind `StepStaging`: pinned host buffers and one event per buffer,
    recorded on `device`'s current stream (the stream `move`'s copy to `device` runs on,
    whichever device is the process's current one)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device("cuda" if device is None else device)
        self.events: dict[int, Any] = {}

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copied(self, slot: int) -> None:
        """Mark the end of the copy just issued from host buffer `slot` to `device`."""
        event = self.events.get(slot)
        if event is None:
            event = self.events[slot] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))

    def wait(self, slot: int) -> None:
        """Block until the last copy from host buffer `slot` has read it."""
        event = self.events.get(slot)
        if event is not None:
            event.synchronize()


class HostCopies:
    """The CPU twin of CudaCopies: a plain host buffer; a copy is done when it returns."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copied(self, slot: int) -> None:
        pass

    def wait(self, slot: int) -> None:
        pass


@dataclass(slots=True)
class Staged:
    """A stage's device buffer (uint8) and the views of its arrays, in order."""

    buffer: torch.Tensor
    tensors: list[torch.Tensor]


class StepStaging:
    """Stages arrays for `device` through two persistent host buffers (`capacity` bytes each
    to start with, grown by doubling, allocated at first use or by `reserve`) with one copy a
    stage; see the module docstring."""

    def __init__(
        self,
        device: torch.device | str,
        capacity: int = 1 << 16,
        runtime: CudaCopies | HostCopies | None = None,
    ) -> None:
        self.device = torch.device(device)
        if runtime is None:
            runtime = CudaCopies(self.device) if self.device.type == "cuda" else HostCopies()
        self.runtime = runtime
        self.capacity = max(capacity, ALIGN)
        self.hosts: list[tuple[torch.Tensor, np.ndarray] | None] = [None, None]
        self.slot = 1  # the buffer the last stage used

    def reserve(self) -> None:
        """Allocate both host buffers now (outside the step loop) rather than at first use."""
        for slot in (0, 1):
            self._host(slot, 0)

    def _host(self, slot: int, nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
        """Host buffer `slot`, at least `nbytes` large, and its numpy view (made once a buffer:
        writes go through numpy, without a torch call per array). The caller has waited for
        the buffer's last copy, so a buffer it outgrows may go."""
        have = self.hosts[slot]
        if have is None or have[0].numel() < nbytes:
            size = self.capacity if have is None else have[0].numel()
            while size < nbytes:
                size *= 2
            t = self.runtime.host_buffer(size)
            have = self.hosts[slot] = (t, t.numpy())
        return have

    def stage(self, arrays: Sequence[Array]) -> Staged:
        """`arrays` on the device as views of one buffer, moved with one copy (`move`)."""
        specs = [(a.resolved_shape(), a.dtype) for a in arrays]
        offsets, total = layout(specs)
        total = -(-total // ALIGN) * ALIGN  # whole ALIGN units: `views` reinterprets it all
        slot = 1 - self.slot
        self.runtime.wait(slot)  # the copy that last read this buffer is done
        host, flat = self._host(slot, total)
        for array, (shape, dtype), start in zip(arrays, specs, offsets, strict=True):
            nbytes = _numel(shape) * dtype.itemsize
            dst: np.ndarray = flat[start : start + nbytes].view(_NUMPY[dtype]).reshape(shape)
            if callable(array.values):
                array.values(dst)
            else:
                dst[...] = array.values
        buffer = move(host[:total], self.device, copy=True)
        self.runtime.copied(slot)
        self.slot = slot
        return Staged(buffer, views(buffer, specs))


def stage_once(arrays: Sequence[Array], device: torch.device | str | None) -> list[torch.Tensor]:
    """`arrays` staged through a staging of their own, sized to fit (for one-off uploads
    outside the step loop: tests, the profiling forward, lazily built layouts); `device`
    None = the host."""
    _, total = layout([(a.resolved_shape(), a.dtype) for a in arrays])
    staging = StepStaging("cpu" if device is None else device, capacity=total)
    return staging.stage(arrays).tensors


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
