"""Redistribute sequences' KV heads between two nested TP layouts (`reshard_kv`), on plain tensors.

Everything moves inside the *exchange group*, the TP group of the larger layout: TP groups are
consecutive ranks, so it holds every old replica that merges into a new one, or every new
replica an old one splits into. Position `i` in it is old TP rank `i % src_tp` of old replica
`i // src_tp` and new TP rank `i % dst_tp` of new replica `i // dst_tp`. A head a receiver
already holds stays; the rest go as one batch of sends and receives in bounded chunks (on
NCCL the group's own communicator carries a batch: no pair communicator is made).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from patrl.tpreshard.comm import batch_send_recv
from patrl.tpreshard.layout import ParallelLayout
from patrl.tpreshard.shard import head_range

__all__ = ["KVReshardStats", "KVShape", "SequenceMove", "heads_sent", "reshard_kv"]

_CHUNK_BYTES = 4 << 20  # bound on one message, so no transfer needs a second whole copy


@dataclass(frozen=True, slots=True)
class KVShape:
    """What every sequence's KV has in common: layers, KV heads in all, head size, dtype, and
    the device its tensors and receive buffers live on."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True, slots=True)
class SequenceMove:
    """One sequence's way through a reshard, the same on every rank of the exchange group:
    from old replica `src_replica` to new replica `dst_replica` (both counted inside the
    group), `num_tokens` of KV. The first `skip` tokens of heads that cross ranks are not
    sent (the receiver already holds them elsewhere); their rows come back unfilled."""

    key: Hashable
    src_replica: int
    dst_replica: int
    num_tokens: int
    skip: int = 0


@dataclass(frozen=True, slots=True)
class _Route:
    """Heads [lo, hi) of sequence `move` go from exchange position `src` to `dst`."""

    move: SequenceMove
    src: int
    dst: int
    lo: int
    hi: int


def reshard_kv(
    local: Mapping[Hashable, tuple[torch.Tensor, torch.Tensor]],
    moves: Sequence[SequenceMove],
    src: ParallelLayout,
    dst: ParallelLayout,
    shape: KVShape,
    stats: KVReshardStats | None = None,
) -> dict[Hashable, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (k, v) under `dst` of every sequence its new replica takes, each
    [layers, tokens, local heads, head_dim] with the heads `head_range(num_kv_heads, dst)`.

    `local` holds this rank's (k, v) under `src` of each sequence of its old replica (heads
    `head_range(num_kv_heads, src)`, at least `num_tokens` tokens). Collective over the exchange
    group: every rank passes the same `moves`, in the same order. A slice that comes whole
    from one place is a view (of `local`, or of the received message); `stats` counts bytes."""
    big = _check_layouts(src, dst)
    routes = [r for m in moves for r in _routes(m, src.tp_size, dst.tp_size, shape.num_kv_heads)]
    me = big.tp_rank
    src_start = head_range(shape.num_kv_heads, src.tp_rank, src.tp_size)[0]
    dst_start = head_range(shape.num_kv_heads, dst.tp_rank, dst.tp_size)[0]
    parts: dict[Hashable, list[_Part]] = {
        m.key: [] for m in moves if m.dst_replica == me // dst.tp_size
    }
    ops: list[tuple[bool, torch.Tensor, int, int]] = []
    pending = []
    for index, route in enumerate(routes):
        if me not in (route.src, route.dst):
            continue
        m = route.move
        if route.src == route.dst:
            parts[m.key].append(_kept(local[m.key], route, src_start))
            continue
        if route.src == me:
            msg = _message(local[m.key], route, src_start)
        else:
            buf = _buffer(shape, m.num_tokens, route.hi - route.lo)
            pending.append((route, buf))
            msg = buf[m.skip :]
        _count(stats, msg, sent=route.src == me)
        ops += _chunks(msg, index, route, me)
    for work in batch_send_recv(big.tp_group, ops):
        if work is not None:
            work.wait()
    for route, buf in pending:
        k, v = buf.permute(1, 2, 0, 3, 4).unbind(0)  # -> [layers, tokens, heads, head_dim] each
        parts[route.move.key].append(_Part(route.lo, route.hi, k, v))
    heads = head_range(shape.num_kv_heads, dst.tp_rank, dst.tp_size)[1]
    return {key: _assemble(p, dst_start, heads) for key, p in parts.items()}


def heads_sent(move: SequenceMove, src_tp: int, dst_tp: int, num_kv_heads: int) -> int:
    """KV heads of `move`'s sequence that `reshard_kv` sends between ranks (summed over the
    ranks of its new replica): what migrating it costs, per token and layer, in K and in V."""
    routes = _routes(move, src_tp, dst_tp, num_kv_heads)
    return sum(r.hi - r.lo for r in routes if r.src != r.dst)


@dataclass(slots=True)
class KVReshardStats:
    """What one `reshard_kv` sent and received on this rank (message bytes, skipped rows not
    counted)."""

    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass(frozen=True, slots=True)
class _Part:
    """Heads [lo, hi) of one sequence under `dst`: k and v [layers, tokens, hi - lo, head_dim]."""

    lo: int
    hi: int
    k: torch.Tensor
    v: torch.Tensor


def _count(stats: KVReshardStats | None, msg: torch.Tensor, sent: bool) -> None:
    if stats is None:
        return
    if sent:
        stats.bytes_sent += msg.nbytes
    else:
        stats.bytes_received += msg.nbytes


def _kept(kv: tuple[torch.Tensor, torch.Tensor], route: _Route, src_start: int) -> _Part:
    """Heads this rank keeps: a view of its old slice (the importer copies it, once)."""
    a, b = route.lo - src_start, route.hi - src_start
    tokens = route.move.num_tokens
    return _Part(route.lo, route.hi, kv[0][:, :tokens, a:b], kv[1][:, :tokens, a:b])


def _assemble(parts: list[_Part], dst_start: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's slice under `dst` from its parts: the part itself when it is the whole
    slice (no copy), else the parts copied side by side."""
    if len(parts) == 1 and parts[0].hi - parts[0].lo == heads:
        return parts[0].k, parts[0].v
    first = parts[0].k
    size = (first.shape[0], first.shape[1], heads, first.shape[3])
    k = torch.empty(size, dtype=first.dtype, device=first.device)
    v = torch.empty_like(k)
    for part in parts:
        lo, hi = part.lo - dst_start, part.hi - dst_start
        k[:, :, lo:hi].copy_(part.k)
        v[:, :, lo:hi].copy_(part.v)
    return k, v


def _check_layouts(src: ParallelLayout, dst: ParallelLayout) -> ParallelLayout:
    """The larger layout, whose TP group is the exchange group; raise unless nested."""
    big, small = (dst, src) if dst.tp_size > src.tp_size else (src, dst)
    if big.tp_size == small.tp_size or big.tp_size % small.tp_size:
        raise ValueError(
            f"reshard_kv needs one TP size to be a multiple of the other, and different: "
            f"got src tp_size={src.tp_size}, dst tp_size={dst.tp_size}"
        )
    if big.tp_group is None:
        raise ValueError(f"the larger layout (tp_size={big.tp_size}) has no TP group")
    return big


def _routes(move: SequenceMove, src_tp: int, dst_tp: int, num_kv: int) -> list[_Route]:
    """Which exchange position sends which heads to each rank of the sequence's new replica."""
    old_ranks = [move.src_replica * src_tp + t for t in range(src_tp)]
    routes: list[_Route] = []
    for t in range(dst_tp):
        dst = move.dst_replica * dst_tp + t
        lo, n = head_range(num_kv, t, dst_tp)
        for h in range(lo, lo + n):
            src = _holder(h, dst, old_ranks, src_tp, num_kv)
            last = routes[-1] if routes else None
            if last is not None and (last.src, last.dst, last.hi) == (src, dst, h):
                routes[-1] = _Route(move, src, dst, last.lo, h + 1)
            else:
                routes.append(_Route(move, src, dst, h, h + 1))
    return routes


def _holder(head: int, dst: int, old_ranks: list[int], src_tp: int, num_kv: int) -> int:
    """The old rank that sends `head`: the receiver itself when it already holds it."""

    def holds(pos: int) -> bool:
        lo, n = head_range(num_kv, pos % src_tp, src_tp)
        return lo <= head < lo + n

    if dst in old_ranks and holds(dst):
        return dst
    return next(p for p in old_ranks if holds(p))


def _message(kv: tuple[torch.Tensor, torch.Tensor], route: _Route, src_start: int) -> torch.Tensor:
    """[tokens - skip, 2 (k|v), layers, heads, head_dim]: a chunk of tokens is contiguous."""
    k, v = kv
    m = route.move
    lo, hi = route.lo - src_start, route.hi - src_start
    shape = (m.num_tokens - m.skip, 2, k.shape[0], hi - lo, k.shape[3])
    msg = torch.empty(shape, dtype=k.dtype, device=k.device)
    msg[:, 0].copy_(k[:, m.skip : m.num_tokens, lo:hi].transpose(0, 1))
    msg[:, 1].copy_(v[:, m.skip : m.num_tokens, lo:hi].transpose(0, 1))
    return msg


def _buffer(shape: KVShape, tokens: int, heads: int) -> torch.Tensor:
    size = (tokens, 2, shape.num_layers, heads, shape.head_dim)
    return torch.empty(size, dtype=shape.dtype, device=shape.device)


def _chunks(
    msg: torch.Tensor, index: int, route: _Route, me: int
) -> list[tuple[bool, torch.Tensor, int, int]]:
    """The sends or receives of `msg` in chunks of at most `_CHUNK_BYTES`, as
    (is_send, chunk, peer, tag); tags both sides derive."""
    step = max(1, _CHUNK_BYTES // max(1, msg[:1].nbytes))
    send = route.src == me
    peer = route.dst if send else route.src
    return [
        (send, msg[s : s + step], peer, (index << 16) | c)
        for c, s in enumerate(range(0, len(msg), step))
    ]
