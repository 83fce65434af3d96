"""In-place weight resharding of a module between two TP layouts (`reshard_`).

Every parameter with a `shard_spec` is re-cut for the destination layout and every module's
`layout` attribute is swapped. One rule serves every spec: an *index map* says which rows of
the full tensor a rank holds. From TP 1 the new shard is a selection of the old one, cut inside
the old storage on CPU (fresh pages would cost more than the copy); from TP > 1 the shards are
all-gathered in the source TP group and each rank picks its rows. Copies only, so the result
equals a fresh load bit for bit. `keep_full=True` keeps a rank's full tensors on a move out of
TP 1, so the way back is free; anything that writes into the shards must `forget_full` first.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from patrl.tpreshard.comm import all_reduce, tp_all_gather_into
from patrl.tpreshard.layout import ParallelLayout
from patrl.tpreshard.shard import ShardSpec, is_input_major, shard_tensor

__all__ = [
    "ReshardStats",
    "copy_plan",
    "forget_full",
    "has_full",
    "index_map",
    "reshard_",
    "restore_full_",
]

_FULL = "_patrl_full"  # on a parameter: its full (TP 1) tensor, kept by reshard_(keep_full=True)
# On a parameter back at TP 1: the copied shard of its last fold, reused by the next one
# (touched pages: no page faults to pay again)
_SHARD = "_patrl_shard"


@dataclass(slots=True)
class ReshardStats:
    """What one `reshard_` did on this rank."""

    num_params: int = 0
    num_gathered: int = 0  # parameters that needed an all-gather
    bytes_received: int = 0  # bytes this rank received in all-gathers
    bytes_before: int = 0  # parameter bytes at the source layout
    bytes_after: int = 0  # parameter bytes at the destination layout
    peak_bytes: int = 0  # max over the move of live parameter bytes + temporaries, accounted
    bytes_kept: int = 0  # bytes of the full tensors kept (keep_full) beyond the shards' own
    restored: bool = False  # back to TP 1 from the kept full tensors, with no communication


def index_map(spec: ShardSpec, full_rows: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The full-tensor row (along the split dimension) of each local row; -1 for padding."""
    assert spec.dim is not None
    ids = torch.arange(1, full_rows + 1)
    shaped = ids.view(-1, 1) if spec.dim == 0 else ids.view(1, -1)
    return shard_tensor(shaped, spec, tp_rank, tp_size).reshape(-1) - 1


@torch.no_grad()
def reshard_(
    module: nn.Module, src: ParallelLayout, dst: ParallelLayout, *, keep_full: bool = False
) -> ReshardStats:
    """Re-cut every sharded parameter of `module` from `src` to `dst`, in place.

    Every rank of the source TP group must call this (it may all-gather there). A destination
    TP size that a spec cannot split raises before anything changes. `keep_full` (from TP 1
    only) keeps the full tensors for a free way back (see the module's docstring); a move to
    TP 1 takes them back whenever every rank of the source group still has them.
    """
    if keep_full and src.tp_size != 1:
        raise ValueError(f"keep_full needs a move out of TP 1, not out of tp_size={src.tp_size}")
    params = _sharded_params(module)
    plans = [(p, owner, _full_rows(p, owner, src.tp_size)) for p, owner in params]
    for p, _, rows in plans:  # validate every cut first: a failure leaves the module untouched
        spec: ShardSpec = p.shard_spec  # type: ignore[attr-defined]
        if spec.dim is not None:
            _dst_rows(spec, rows, dst.tp_rank, dst.tp_size)
    stats = ReshardStats(num_params=len(plans))
    live = stats.bytes_before = sum(p.nbytes for p, _, _ in plans)
    stats.peak_bytes = live
    if dst.tp_size == 1 and src.tp_size > 1 and _all_kept(module, src):
        stats.bytes_kept = restore_full_(module, dst) or 0
        stats.bytes_after = stats.peak_bytes = sum(p.nbytes for p, _, _ in plans)
        stats.restored = True
        return stats
    forget_full(module)  # a move other than the way back: the weights' history ends here
    if not keep_full:
        _drop_spares(module)
    for p, _, rows in plans:
        spec = p.shard_spec  # type: ignore[attr-defined]
        if spec.dim is None:
            continue
        old_bytes = p.nbytes
        if keep_full:
            new = _shard_of_full(p.data, spec, rows, dst, getattr(p, _SHARD, None))
            if hasattr(p, _SHARD):
                delattr(p, _SHARD)
            setattr(p, _FULL, p.data)
            copied = not _same_storage(new, p.data)
            stats.bytes_kept += old_bytes - (0 if copied else new.nbytes)
            extra, received = (new.nbytes if copied else 0), 0
        else:
            new, extra, received = _recut(p, spec, rows, src, dst)
        stats.peak_bytes = max(stats.peak_bytes, live + extra)
        stats.bytes_received += received
        stats.num_gathered += received > 0
        p.data = new
        live += new.nbytes - old_bytes
    stats.bytes_after = live + stats.bytes_kept
    _set_layout(module, dst)
    return stats


def has_full(module: nn.Module) -> bool:
    """Whether `module`'s sharded parameters all still have the full tensors that
    `reshard_(keep_full=True)` kept (on this rank)."""
    params = [p for p, _ in _sharded_params(module) if _split(p)]
    return bool(params) and all(hasattr(p, _FULL) for p in params)


def _split(p: torch.Tensor) -> bool:
    spec: ShardSpec = p.shard_spec  # type: ignore[attr-defined]
    return spec.dim is not None


def restore_full_(module: nn.Module, dst: ParallelLayout) -> int | None:
    """Back to TP 1 (`dst`) from the full tensors kept on this rank, with no communication;
    None, and nothing changed, where some are missing. For a caller that decides alone (a
    rank about to load every weight anyway); `reshard_` makes the ranks agree first. The
    copied shards stay for the next fold to fill; returns their bytes."""
    if dst.tp_size != 1:
        raise ValueError(f"the kept full tensors are a TP 1 layout, not tp_size={dst.tp_size}")
    if not has_full(module):
        return None
    kept = 0
    for p, _ in _sharded_params(module):
        full = getattr(p, _FULL, None)
        if full is None:
            continue
        if not _same_storage(p.data, full):
            setattr(p, _SHARD, p.data)
            kept += p.nbytes
        p.data = full
        delattr(p, _FULL)
    _set_layout(module, dst)
    return kept


def forget_full(module: nn.Module) -> None:
    """Drop the full tensors kept beside `module`'s shards (call it before writing into the
    shards: the full tensors would go stale)."""
    for p, _ in _sharded_params(module):
        if hasattr(p, _FULL):
            delattr(p, _FULL)


def kept_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors `reshard_` keeps beside `module`'s parameters (full tensors and spare
    shards): with the parameters, all the weight memory a module holds on this rank."""
    kept = []
    for p, _ in _sharded_params(module):
        kept += [getattr(p, name) for name in (_FULL, _SHARD) if hasattr(p, name)]
    return kept


def _drop_spares(module: nn.Module) -> None:
    for p, _ in _sharded_params(module):
        if hasattr(p, _SHARD):
            delattr(p, _SHARD)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _all_kept(module: nn.Module, src: ParallelLayout) -> bool:
    """`has_full` on every rank of the source group (one small all-reduce: the ranks must
    agree, or one would gather while another would not). The flag lives on the weights'
    device: the TP group may be NCCL."""
    ok = has_full(module)
    if src.tp_group is None:
        return ok
    device = next(module.parameters()).device
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    all_reduce(src.tp_group, flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _shard_of_full(
    full: torch.Tensor,
    spec: ShardSpec,
    rows: int,
    dst: ParallelLayout,
    spare: torch.Tensor | None,
) -> torch.Tensor:
    """This rank's shard of a full tensor that stays: a view where it is one contiguous block
    of the storage, else a copy (into `spare`, the last fold's copy, when it fits). A strided
    view would cost no copy but slow every matmul that reads it."""
    dim = spec.dim
    assert dim is not None
    transposed = is_input_major(full)
    new_shape = list(full.shape)
    new_shape[dim], zeros = _dst_rows(spec, rows, dst.tp_rank, dst.tp_size)
    runs = copy_plan(spec, rows, 1, dst.tp_rank, dst.tp_size)
    if len(runs) == 1 and not zeros:
        i, _, w, n = runs[0]
        view = full.narrow(dim, w, n)
        if i == 0 and n == new_shape[dim] and _storage(view, transposed).is_contiguous():
            return view
    if spare is not None and _fits(spare, full, new_shape, transposed):
        new = spare
        if zeros:  # padding rows: zeros, as in a fresh load
            new.zero_()
    else:
        new = _alloc(full, new_shape, zeros, transposed)
    _copy_runs(new, full, dim, runs)
    return new


def _fits(spare: torch.Tensor, like: torch.Tensor, shape: list[int], transposed: bool) -> bool:
    """Whether `spare` can be the new shard: its shape, dtype, device and memory order."""
    return (
        list(spare.shape) == shape
        and spare.dtype == like.dtype
        and spare.device == like.device
        and is_input_major(spare) == transposed
        and _storage(spare, transposed).is_contiguous()
    )


def _set_layout(module: nn.Module, layout: ParallelLayout) -> None:
    for m in module.modules():
        if isinstance(getattr(m, "layout", None), ParallelLayout):
            setattr(m, "layout", layout)  # noqa: B010 (nn.Module types attributes as Tensor | Module)


def _recut(
    p: torch.Tensor, spec: ShardSpec, rows: int, src: ParallelLayout, dst: ParallelLayout
) -> tuple[torch.Tensor, int, int]:
    """(new local tensor, most bytes held at once beyond the other parameters' minus the old
    shard, bytes received). Through shared memory the shards stream into the new tensor
    (`_gather_runs`); otherwise a gathered old shard is released before the new one is made.
    Either way a shrink peaks at the new layout's weights + one full parameter."""
    old = p.data
    dim = spec.dim
    assert dim is not None
    new_shape = list(old.shape)
    # Padding rows (vocabulary past its end) are zeros, as in a fresh load.
    new_shape[dim], zeros = _dst_rows(spec, rows, dst.tp_rank, dst.tp_size)
    transposed = is_input_major(old)  # its re-cut is stored the same way
    runs = copy_plan(spec, rows, src.tp_size, dst.tp_rank, dst.tp_size)
    if src.tp_size == 1:  # this rank holds every row: narrow, no communication
        narrowed = _narrow_in_place(old, new_shape, dim, transposed, runs, zeros)
        if narrowed is not None:
            return narrowed, 0, 0
        new = _alloc(old, new_shape, zeros, transposed)
        _copy_runs(new, old, dim, runs)
        return new, new.nbytes, 0
    # Every rank of the source group must take the same branch (the gather is collective), and
    # from tp > 1 some rank of the group always misses rows, so all of them gather.
    if _streams(src, old):
        new = _alloc(old, new_shape, zeros, transposed)
        _gather_runs(src, old, new, dim, transposed, runs)
        return new, new.nbytes, old.nbytes * (src.tp_size - 1)
    if transposed:  # gather the contiguous storage, then view each shard as [out, in] again
        buf = torch.empty((src.tp_size, *old.shape[::-1]), dtype=old.dtype, device=old.device)
        tp_all_gather_into(src, buf, old.t())
        buf = buf.transpose(1, 2)
    else:
        buf = torch.empty((src.tp_size, *old.shape), dtype=old.dtype, device=old.device)
        tp_all_gather_into(src, buf, old)
    old_bytes = old.nbytes
    p.data = old = old.new_empty(0)  # buf holds this shard now: free the old storage
    new = _alloc(old, new_shape, zeros, transposed)
    _copy_runs(new, buf, dim, runs)
    extra = max(old_bytes + buf.nbytes, buf.nbytes + new.nbytes) - old_bytes
    return new, extra, buf.nbytes - old_bytes


def _storage(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`t`'s contiguous storage as 2-D rows (an input-major weight's transpose; a vector as a
    column)."""
    s = t.t() if transposed else t
    return s.view(-1, 1) if s.dim() == 1 else s


def _streams(src: ParallelLayout, old: torch.Tensor) -> bool:
    """Whether the shared-memory gather can stream this parameter a block of rows at a time
    straight into its new shard (else it is gathered whole, then copied)."""
    comm = src.tp_comm
    if comm is None or old.dim() > 2:
        return False
    storage = _storage(old, is_input_major(old))
    return storage.is_contiguous() and storage.shape[1] * old.element_size() <= comm.slot_bytes


def _gather_runs(
    src: ParallelLayout,
    old: torch.Tensor,
    new: torch.Tensor,
    dim: int,
    transposed: bool,
    runs: tuple[tuple[int, int, int, int], ...],
) -> None:
    """new = the runs of the source group's shards, placed block by block as the shards arrive
    through shared memory: two copies of each byte (into the slot, out to its place) where a
    whole gather and a re-cut make four, and no gathered buffer. In storage order a run lies
    along rows (the split dimension is the storage's first) or along columns (its second:
    every block of rows holds a piece of every run)."""
    assert src.tp_comm is not None
    target = _storage(new, transposed)
    along_rows = (dim == 0) != transposed or new.dim() == 1
    for lo, hi, parts in src.tp_comm.all_gather_rows(_storage(old, transposed)):
        for i, r, w, n in runs:
            if along_rows:
                a, b = max(w, lo), min(w + n, hi)
                if a < b:
                    target[i + a - w : i + b - w].copy_(parts[r][a - lo : b - lo])
            else:
                target[lo:hi, i : i + n].copy_(parts[r][:, w : w + n])


def _alloc(like: torch.Tensor, shape: list[int], zeros: bool, transposed: bool) -> torch.Tensor:
    make = torch.zeros if zeros else torch.empty
    if transposed:
        return make(shape[::-1], dtype=like.dtype, device=like.device).t()
    return make(shape, dtype=like.dtype, device=like.device)


def _narrow_in_place(
    old: torch.Tensor,
    new_shape: list[int],
    dim: int,
    transposed: bool,
    runs: tuple[tuple[int, int, int, int], ...],
    zeros: bool,
) -> torch.Tensor | None:
    """The new shard cut inside `old`'s own storage, the rest of whose pages go back to the OS;
    None where that cannot be done (not CPU, the storage shared or not released, a run that
    would have to move backwards), and the caller allocates.

    In storage order (`_storage`: an input-major weight's [in, out] rows) the kept rows or
    columns move towards the front, in place. A copy never reads what an earlier copy wrote:
    along rows, a run moves to an earlier row (i <= w) in pieces no longer than the distance
    it moves; along columns, rows go in blocks [a, b) whose new place ends before their old
    place starts (b * new_width <= a * old_width: blocks grow geometrically), the first row
    through a copy of itself. One run along rows is not moved at all: the shard is a view."""
    if not _can_release() or old.device.type != "cpu" or old.dim() > 2:
        return None
    storage = _storage(old, transposed)
    storage_bytes = old.untyped_storage().nbytes()
    if (
        not storage.is_contiguous()
        or old.storage_offset() != 0
        or storage_bytes != old.numel() * old.element_size()
    ):
        return None  # a view of something larger, or padded: other tensors may share it
    if any(i > w for i, _, w, _ in runs):
        return None
    along_rows = (dim == 0) != transposed or old.dim() == 1
    new_rows, new_cols = (
        (new_shape[::-1] if transposed else new_shape) if old.dim() == 2 else [new_shape[0], 1]
    )
    flat = storage.reshape(-1)
    cols = storage.shape[1]
    if along_rows and len(runs) == 1 and not zeros:
        i, _, w, n = runs[0]  # i == 0: the shard is rows [w, w + n) as they are
        start = w * cols
        target = flat[start : start + n * cols].view(n, cols)
        _release(flat, start, start + n * cols)
        return _as_param(target, new_shape, transposed)
    target = flat[: new_rows * new_cols].view(new_rows, new_cols)
    if along_rows:
        for i, _, w, n in runs:
            step = w - i
            if step == 0:
                continue
            for k in range(0, n, step):
                m = min(step, n - k)
                target[i + k : i + k + m].copy_(storage[w + k : w + k + m])
    else:
        a = 0
        while a < new_rows:
            b = min(new_rows, (a * cols) // new_cols)
            if b > a:
                block = storage[a:b]
            else:  # the first row (or, with padding, a row that overlaps its new place)
                b = a + 1
                block = storage[a:b].clone()
            for i, _, w, n in runs:
                target[a:b, i : i + n].copy_(block[:, w : w + n])
            a = b
    if zeros:  # padding rows (a vocabulary past its end): zeros, as in a fresh load
        covered = torch.zeros(new_rows if along_rows else new_cols, dtype=torch.bool)
        for i, _, _, n in runs:
            covered[i : i + n] = True
        for k in (~covered).nonzero().flatten().tolist():
            (target[k] if along_rows else target[:, k]).zero_()
    _release(flat, 0, new_rows * new_cols)
    return _as_param(target, new_shape, transposed)


def _as_param(target: torch.Tensor, new_shape: list[int], transposed: bool) -> torch.Tensor:
    """The [rows, cols] storage view as the parameter's own shape and layout."""
    if transposed:
        return target.t()
    return target.view(new_shape)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4  # Linux: private anonymous pages are dropped; touched again, they read 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def _can_release() -> bool:
    return _libc() is not None


def _release(flat: torch.Tensor, keep_lo: int, keep_hi: int) -> None:
    """Hand back to the OS the whole pages of `flat`'s memory outside elements [keep_lo,
    keep_hi). They stay mapped (the storage keeps its size and frees it as usual); nothing
    reads them again."""
    libc = _libc()
    assert libc is not None
    size = flat.element_size()
    base = flat.data_ptr()
    for lo, hi in (
        (base, base + keep_lo * size),
        (base + keep_hi * size, base + flat.numel() * size),
    ):
        first = -(-lo // _PAGE) * _PAGE
        last = (hi // _PAGE) * _PAGE
        if last > first and libc.madvise(first, last - first, _MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(
                err, f"madvise(MADV_DONTNEED) of {last - first} bytes: {os.strerror(err)}"
            )


@functools.lru_cache(maxsize=1024)
def _dst_rows(spec: ShardSpec, rows: int, dst_rank: int, dst_tp: int) -> tuple[int, bool]:
    """(local rows, whether some are padding) of rank `dst_rank` of `dst_tp`; raises when the
    spec cannot be cut so. Cached, as copy_plan."""
    dst_map = index_map(spec, rows, dst_rank, dst_tp)
    return dst_map.numel(), bool((dst_map < 0).any())


# Cached: every layer of a model repeats the same few (spec, rows) pairs, and an engine moves
# between the same layouts again and again; a plan is a few tuples.
@functools.lru_cache(maxsize=1024)
def copy_plan(
    spec: ShardSpec, rows: int, src_tp: int, dst_rank: int, dst_tp: int
) -> tuple[tuple[int, int, int, int], ...]:
    """How rank `dst_rank` of `dst_tp` builds its shard from the `src_tp` source shards: runs
    `(start, source rank, source row, length)` along the split dimension, maximal, in order;
    padding rows are in no run. The lowest source rank holding a row sends it.

    Derived with tensor ops on the index maps: a per-row Python walk over a 32000-row
    vocabulary cost as much as the copy itself (the tests keep that walk as the twin)."""
    dst_map = index_map(spec, rows, dst_rank, dst_tp)
    rank = torch.full_like(dst_map, -1)
    row = torch.full_like(dst_map, -1)
    for r in reversed(range(src_tp)):
        where = _positions(index_map(spec, rows, r, src_tp), rows)[dst_map.clamp(min=0)]
        held = (dst_map >= 0) & (where >= 0)
        rank[held] = r
        row[held] = where[held]
    return tuple(_runs(rank, row))


def _runs(rank: torch.Tensor, row: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Local row i takes row[i] of source rank[i] (-1: none). A run starts wherever a row
    does not continue the previous one: another rank, or not the next source row."""
    n = rank.numel()
    if n == 0:
        return []
    fresh = torch.ones(n, dtype=torch.bool)
    fresh[1:] = (rank[1:] != rank[:-1]) | (row[1:] != row[:-1] + 1)
    starts = fresh.nonzero().flatten()
    lengths = torch.diff(starts, append=torch.tensor([n]))
    keep = rank[starts] >= 0
    starts, lengths = starts[keep], lengths[keep]
    return list(
        zip(
            starts.tolist(),
            rank[starts].tolist(),
            row[starts].tolist(),
            lengths.tolist(),
            strict=True,
        )
    )


def _copy_runs(
    new: torch.Tensor, source: torch.Tensor, dim: int, runs: tuple[tuple[int, int, int, int], ...]
) -> None:
    """new[i : i + n] = source[r][w : w + n] (source[w : w + n] for a single tensor) along
    `dim`, for each run (i, r, w, n): a handful of memcpy-like copies per parameter."""
    single = source.dim() == new.dim()
    for i, r, w, n in runs:
        piece = source if single else source[r]
        new.narrow(dim, i, n).copy_(piece.narrow(dim, w, n))


def _positions(local_map: torch.Tensor, rows: int) -> torch.Tensor:
    """For each full row, its position in the local tensor described by `local_map`, or -1."""
    inverse = torch.full((rows,), -1, dtype=torch.long)
    valid = local_map >= 0
    inverse[local_map[valid]] = valid.nonzero().flatten()
    return inverse


def _sharded_params(module: nn.Module) -> list[tuple[nn.Parameter, nn.Module]]:
    """Each sharded parameter once (tied weights are one parameter), with its owning module."""
    seen: set[int] = set()
    out: list[tuple[nn.Parameter, nn.Module]] = []
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if id(p) in seen or not hasattr(p, "shard_spec"):
                continue
            seen.add(id(p))
            out.append((p, m))
    return out


def _full_rows(p: torch.Tensor, owner: nn.Module, tp_size: int) -> int:
    """The full tensor's size along the split dimension."""
    spec: ShardSpec = p.shard_spec  # type: ignore[attr-defined]
    if spec.dim is None:
        return 0
    if spec.kind == "vocab":
        vocab = getattr(owner, "vocab_size", None)
        if not isinstance(vocab, int):
            raise ValueError(
                f"a vocab-sharded parameter of {type(owner).__name__} needs its module's "
                "vocab_size (the padding of the last rank hides the true size)"
            )
        return vocab
    if spec.parts:
        return sum(part.size for part in spec.parts)
    return int(p.shape[spec.dim]) * tp_size
