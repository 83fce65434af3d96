"""Live TP reconfiguration of an engine: (dp, tp) -> (dp', tp') in the middle of generation.

All movement happens inside the *exchange group*, the TP group of the larger layout: it holds
every old replica that merges into a new one, or every new replica an old one splits into.
Every rank of the world, at once: (1) exports its unfinished samples, the old first ranks
sharing the states so every rank derives the same plan; (2) re-cuts the weights in place
(`tpreshard.reshard_`, full tensors kept out of TP 1 so the way back is free) and rebuilds
cache and scheduler; (3) per sample, migrates KV heads (paired send/recv in bounded chunks; a
prompt's full blocks sent once per replica pair) or drops them for a recompute; (4) imports
the samples, split between new replicas by whole requests. See docs/adaptive_tp.md.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from patrl.kvstore import SequenceKV
from patrl.rollout.engine import Engine
from patrl.rollout.outputs import SequenceState
from patrl.tpreshard import ParallelLayout, ReshardStats, head_range, reshard_

KVChoice = Literal["migrate", "recompute"]
_CHUNK_BYTES = 4 << 20  # bound on one KV message, so no transfer needs a second whole copy
# the engines a reconfigure is moving now: a second one (from a kv_policy callback) refuses
_moving: weakref.WeakSet[Engine] = weakref.WeakSet()


@dataclass(frozen=True, slots=True)
class KVCost:
    """What each choice would cost for one unfinished sample, for the planner to price."""

    request_id: str
    sample_index: int
    migrate_bytes: int  # KV bytes that would cross ranks (all layers, K and V)
    recompute_tokens: int  # tokens a recompute would prefill


KVPolicy = KVChoice | Callable[[KVCost], KVChoice]


@dataclass(slots=True)
class ReconfigReport:
    src_tp: int
    dst_tp: int
    weights_s: float = 0.0
    kv_s: float = 0.0
    groups_s: float = 0.0  # layout look-up and state exchange between the old first ranks
    cache_s: float = 0.0  # freeing the old KV cache and allocating the new layout's
    total_s: float = 0.0
    weight_bytes_received: int = 0
    weight_peak_bytes: int = 0  # accounted peak of parameter bytes + temporaries on this rank
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    num_migrated: int = 0
    num_recomputed: int = 0
    tokens_recomputed: int = 0
    costs: list[KVCost] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Move:
    """Heads [lo, hi) of sample `key`'s KV go from exchange position `src` to `dst`."""

    key: tuple[str, int]
    src: int
    dst: int
    lo: int
    hi: int
    skip: int = 0  # leading tokens not sent: an earlier sample of the prompt sent them


def reconfigure(
    engine: Engine, target: int | ParallelLayout, kv_policy: KVPolicy = "migrate"
) -> ReconfigReport:
    """Move `engine` to another TP layout mid-generation; every rank of the world calls it at
    once. `target` is a TP size looked up in the engine's GroupCache, or a layout from it.
    Unfinished samples keep their tokens, logprobs and generator states; their KV is migrated
    or recomputed as `kv_policy` says. Bad targets raise before anything changes."""
    dst = target_layout(engine, target)
    check_target(engine, dst)
    _moving.add(engine)
    try:
        return _reconfigure(engine, dst, kv_policy)
    finally:
        _moving.discard(engine)


def target_layout(engine: Engine, target: int | ParallelLayout) -> ParallelLayout:
    """The layout `target` names for `engine` (raises when it cannot be one of its group's)."""
    engine.model.config.check_tp(target.tp_size if isinstance(target, ParallelLayout) else target)
    if isinstance(target, ParallelLayout):
        if engine.groups is not None and target != engine.groups.layout(target.tp_size):
            raise ValueError(
                f"layout with tp_size={target.tp_size} is not this engine's GroupCache "
                "layout: pass a TP size or groups.layout(tp)"
            )
        return target
    if engine.groups is None:
        raise ValueError(
            f"reconfigure({target}) needs the engine's GroupCache: Engine(..., groups=...)"
        )
    return engine.groups.layout(target)


def check_target(engine: Engine, dst: ParallelLayout) -> None:
    """Raise, before anything changes, unless `engine` can move to `dst`."""
    src = engine.layout
    if engine in _moving:
        raise RuntimeError("a reconfigure is already in progress on this engine")
    if dst.tp_size == src.tp_size:
        raise ValueError(f"the engine is already at tp_size={dst.tp_size}")
    engine.model.config.check_tp(dst.tp_size)
    big, small = (dst, src) if dst.tp_size > src.tp_size else (src, dst)
    if big.tp_size % small.tp_size:
        raise ValueError(
            f"tp_size {small.tp_size} does not divide {big.tp_size}: replicas can only merge "
            "into, or split out of, one TP group"
        )
    if big.tp_group is None:
        raise ValueError(f"target layout tp_size={dst.tp_size} has no TP group")


def _reconfigure(engine: Engine, dst: ParallelLayout, kv_policy: KVPolicy) -> ReconfigReport:
    src = engine.layout
    t0 = time.perf_counter()
    report = ReconfigReport(src.tp_size, dst.tp_size)
    big = dst if dst.tp_size > src.tp_size else src
    group = big.tp_group
    assert group is not None  # check_target
    size = dist.get_world_size(group)
    me = big.tp_rank

    # 1. everything unfinished leaves the engine; the old first ranks share the states.
    ids = list(engine.request_ids())
    gathered_ids: list[list[str]] = [[] for _ in range(size)]
    dist.all_gather_object(gathered_ids, ids if src.tp_rank == 0 else [], group=group)
    _check_unique(gathered_ids)
    local = engine.export_requests(ids, with_kv=True)
    mine = {(s.request_id, s.sample_index): s.kv for s in local if s.kv is not None}
    meta = [(dataclasses.replace(s, kv=None), _kv_len(s)) for s in local]
    offer = (meta if src.tp_rank == 0 else [], engine.next_seq_id(), engine.next_request_number())
    gathered: list[tuple[list[tuple[SequenceState, int]], int, int]] = [
        ([], 0, 0) for _ in range(size)
    ]
    dist.all_gather_object(gathered, offer, group=group)
    old = [gathered[j * src.tp_size][0] for j in range(size // src.tp_size)]
    t1 = time.perf_counter()
    report.groups_s = t1 - t0

    # 2. weights, then a fresh cache and scheduler at the new layout.
    # Out of TP 1 (a fold) each rank keeps its full weights unless told not to: it held them
    # a moment ago, and the way back (at the next weight sync, or an unfold) is then free.
    keep_full = src.tp_size == 1 and engine.config.keep_full_weights
    stats: ReshardStats = reshard_(engine.model, src, dst, keep_full=keep_full)
    t_weights = time.perf_counter()
    engine.rebuild(dst)
    engine.advance_ids(max(g[1] for g in gathered), max(g[2] for g in gathered))
    t2 = time.perf_counter()
    report.weights_s = t_weights - t1
    report.cache_s = t2 - t_weights
    report.weight_bytes_received = stats.bytes_received
    report.weight_peak_bytes = stats.peak_bytes
    report.weight_bytes_before, report.weight_bytes_after = stats.bytes_before, stats.bytes_after

    # 3. plan (identically on every rank), then move KV heads.
    assign = _assign(old, size // dst.tp_size)
    config = engine.model.config
    per_token = 2 * config.num_layers * config.head_dim * engine.cache.spec.dtype.itemsize
    moves: list[_Move] = []
    keep: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}  # migrated: (computed, ids)
    # (old replica, new replica, prompt) -> tokens of KV the prompt's first migrated sample sent
    sent: dict[tuple[int, int, tuple[int, ...]], int] = {}
    block = engine.cache.spec.block_size if engine.config.enable_prefix_caching else 0
    for j_old, states in enumerate(old):
        for st, n in states:
            key = (st.request_id, st.sample_index)
            tokens = len(st.prompt_token_ids) + len(st.output_token_ids)
            plan = _plan(key, j_old, assign[key], src.tp_size, dst.tp_size, config.num_kv_heads)
            crossing = sum(m.hi - m.lo for m in plan if m.src != m.dst)
            cost = KVCost(key[0], key[1], crossing * n * per_token, tokens)
            report.costs.append(cost)
            choice = kv_policy(cost) if callable(kv_policy) else kv_policy
            if choice not in ("migrate", "recompute"):
                raise ValueError(f"kv_policy returned {choice!r}; expected migrate or recompute")
            if n > 0 and choice == "migrate":
                prompt = (j_old, assign[key], tuple(st.prompt_token_ids))
                moves += _skip_shared(plan, sent, prompt, n, block)
                keep[key] = (n, tuple(st.prompt_token_ids + st.output_token_ids[:-1]))
                report.num_migrated += 1
            else:
                report.num_recomputed += 1
                report.tokens_recomputed += tokens
    received = _exchange(moves, mine, keep, group, me, engine, report)
    report.kv_s = time.perf_counter() - t2

    # 4. this rank's new replica takes its samples, in plan order.
    my_replica = me // dst.tp_size
    start, count = head_range(config.num_kv_heads, dst.tp_rank, dst.tp_size)
    incoming: list[SequenceState] = []
    for states in old:
        for st, _ in states:
            key = (st.request_id, st.sample_index)
            if assign[key] != my_replica:
                continue
            kv = None
            if key in keep:
                parts = received[key]
                kv = SequenceKV.concat_heads(parts) if len(parts) > 1 else parts[0]
                assert (kv.head_start, kv.num_heads) == (start, count)
            incoming.append(dataclasses.replace(st, kv=kv))
    engine.import_requests(incoming)
    report.total_s = time.perf_counter() - t0
    return report


def _skip_shared(
    plan: list[_Move],
    sent: dict[tuple[int, int, tuple[int, ...]], int],
    prompt: tuple[int, int, tuple[int, ...]],
    n: int,
    block: int,
) -> list[_Move]:
    """A sample's moves, the crossing ones without the prompt's full blocks when an earlier
    sample of the same prompt, old replica and new replica sent them (`sent`, updated): the
    receiver imports that one first, so its prefix cache holds them (`block` 0: no prefix
    cache, everything is sent). GRPO's n samples of a prompt share it, and the prompt is
    often most of every sample's KV."""
    if not block or prompt not in sent:
        sent.setdefault(prompt, n)
        return plan
    skip = min(len(prompt[2]), sent[prompt], n - 1) // block * block
    # local slices too, though nothing is sent: every rank of the new group then holds the
    # same `first` for the sample, and so decides alike whether to import it or recompute
    return [dataclasses.replace(m, skip=skip) for m in plan]


def _kv_len(st: SequenceState) -> int:
    return 0 if st.kv is None else st.kv.num_computed


def _head_view(kv: SequenceKV, start: int, end: int, first: int) -> SequenceKV:
    """Heads [start, end) of `kv` without the copy `SequenceKV.heads` makes."""
    lo, hi = start - kv.head_start, end - kv.head_start
    return SequenceKV(
        kv.token_ids, kv.k[:, :, lo:hi], kv.v[:, :, lo:hi], start, kv.num_total_kv_heads, first
    )


def _check_unique(gathered: list[list[str]]) -> None:
    seen: set[str] = set()
    for ids in gathered:
        clash = seen.intersection(ids)
        if clash:
            raise ValueError(
                f"request ids {sorted(clash)[:5]} are in use on two replicas that would merge; "
                "give requests world-unique ids (add_request(request_id=...))"
            )
        seen.update(ids)


def _assign(old: list[list[tuple[SequenceState, int]]], num_new: int) -> dict[tuple[str, int], int]:
    """New replica (within the exchange group) of every sample: whole requests, balanced."""
    if num_new == 1:
        return {(st.request_id, st.sample_index): 0 for states in old for st, _ in states}
    requests: dict[str, list[SequenceState]] = {}
    for states in old:
        for st, _ in states:
            requests.setdefault(st.request_id, []).append(st)

    def remaining(sts: list[SequenceState]) -> int:
        return sum(s.params.max_tokens - len(s.output_token_ids) for s in sts)

    load = [0] * num_new
    out: dict[tuple[str, int], int] = {}
    order = sorted(requests, key=lambda r: -remaining(requests[r]))  # stable: ties keep order
    for rid in order:
        target = min(range(num_new), key=lambda j: (load[j], j))
        load[target] += remaining(requests[rid])
        for st in requests[rid]:
            out[(rid, st.sample_index)] = target
    return out


def _plan(
    key: tuple[str, int], j_old: int, j_new: int, src_tp: int, dst_tp: int, num_kv: int
) -> list[_Move]:
    """Which exchange position sends which KV heads to each rank of the new replica."""
    old_ranks = [j_old * src_tp + t for t in range(src_tp)]
    moves: list[_Move] = []
    for t in range(dst_tp):
        dst = j_new * dst_tp + t
        lo, n = head_range(num_kv, t, dst_tp)
        for h in range(lo, lo + n):
            src = _holder(h, dst, old_ranks, src_tp, num_kv)
            last = moves[-1] if moves else None
            if last is not None and (last.src, last.dst, last.hi) == (src, dst, h):
                moves[-1] = dataclasses.replace(last, hi=h + 1)
            else:
                moves.append(_Move(key, src, dst, h, h + 1))
    return moves


def _holder(head: int, dst: int, old_ranks: list[int], src_tp: int, num_kv: int) -> int:
    """The old rank that sends `head`: the receiver itself when it already holds it."""

    def holds(pos: int) -> bool:
        lo, n = head_range(num_kv, pos % src_tp, src_tp)
        return lo <= head < lo + n

    if dst in old_ranks and holds(dst):
        return dst
    return next(p for p in old_ranks if holds(p))


def _exchange(
    moves: list[_Move],
    mine: dict[tuple[str, int], SequenceKV],
    keep: dict[tuple[str, int], tuple[int, tuple[int, ...]]],
    group: dist.ProcessGroup,
    me: int,
    engine: Engine,
    report: ReconfigReport,
) -> dict[tuple[str, int], list[SequenceKV]]:
    """Run the moves: local slices stay, the rest go by paired isend/irecv in bounded chunks.

    A message is `[tokens, 2 (k|v), layers, heads, head_dim]`, so a chunk of tokens is a
    contiguous view and the receiver needs no second copy.
    """
    spec = engine.cache.spec
    total = engine.model.config.num_kv_heads
    received: dict[tuple[str, int], list[SequenceKV]] = {}
    works = []
    pending: list[tuple[tuple[str, int], int, torch.Tensor, int]] = []
    for index, m in enumerate(moves):
        if me not in (m.src, m.dst):
            continue
        if m.src == m.dst:  # a view: the import copies it into the cache, once
            received.setdefault(m.key, []).append(_head_view(mine[m.key], m.lo, m.hi, m.skip))
            continue
        n = keep[m.key][0]
        if m.src == me:
            kv = mine[m.key]
            lo, hi = m.lo - kv.head_start, m.hi - kv.head_start
            # one strided copy each of k and v into the message
            shape = (n - m.skip, 2, spec.num_layers, m.hi - m.lo, spec.head_dim)
            msg = torch.empty(shape, dtype=kv.k.dtype, device=kv.k.device)
            msg[:, 0].copy_(kv.k[:, m.skip : n, lo:hi].transpose(0, 1))
            msg[:, 1].copy_(kv.v[:, m.skip : n, lo:hi].transpose(0, 1))
            report.kv_bytes_sent += msg.nbytes
        else:
            # all n tokens' rows, the skipped ones left unfilled (`SequenceKV.first`)
            shape = (n, 2, spec.num_layers, m.hi - m.lo, spec.head_dim)
            buf = torch.empty(shape, dtype=spec.dtype, device=spec.device)
            msg = buf[m.skip :]
            report.kv_bytes_received += msg.nbytes
            pending.append((m.key, m.lo, buf, m.skip))
        step = max(1, _CHUNK_BYTES // max(1, msg[:1].nbytes))
        for c, s in enumerate(range(0, len(msg), step)):
            tag = (index << 16) | c  # unique per message of a pair; both sides derive it
            if m.src == me:
                works.append(dist.isend(msg[s : s + step], group=group, group_dst=m.dst, tag=tag))
            else:
                works.append(dist.irecv(msg[s : s + step], group=group, group_src=m.src, tag=tag))
    for w in works:
        if w is not None:
            w.wait()
    for key, lo, buf, skip in pending:
        k, v = buf.permute(1, 2, 0, 3, 4).unbind(0)  # -> [layers, tokens, heads, head_dim] each
        received.setdefault(key, []).append(SequenceKV(keep[key][1], k, v, lo, total, skip))
    return received
