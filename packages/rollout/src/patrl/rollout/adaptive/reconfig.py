"""Live TP reconfiguration of an engine: (dp, tp) -> (dp', tp') in the middle of generation.

All movement happens inside the *exchange group*, the TP group of the larger layout: it holds
every old replica that merges into a new one, or every new replica an old one splits into.
Every rank of the world, at once: export the unfinished samples (the old first ranks share
the states) -> reshard the weights in place (`tpreshard.reshard_`; full tensors kept out of
TP 1 so the way back is free) -> rebuild cache and scheduler -> reshard the migrated samples'
KV heads (`tpreshard.reshard_kv`; a prompt's full blocks sent once per replica pair) -> import
each sample on the replica the plan names (`switch_plan`). See docs/adaptive_tp.md.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from patrl.kvstore import SequenceKV
from patrl.lenpredict import Layout
from patrl.rollout.adaptive.switch_plan import Key, Row, SwitchPlan, derive_plan
from patrl.rollout.engine import Engine
from patrl.rollout.outputs import SequenceState
from patrl.tpreshard import (
    KVReshardStats,
    KVShape,
    ParallelLayout,
    ReshardStats,
    SequenceMove,
    head_range,
    heads_sent,
    reshard_,
    reshard_kv,
)

KVChoice = Literal["migrate", "recompute"]
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
    """What one `reconfigure` did on this rank: the TP sizes it moved between, seconds per
    phase, bytes of weights and KV moved, how many samples migrated their KV or recomputed
    it (and the tokens recomputed), and the cost of each choice the policy weighed."""

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


@dataclass(slots=True)
class _Shared:
    """The exchange group's samples after the export, the same on every rank of it: per old
    replica (position in the group) its states and KV lengths; this rank's own KV."""

    old: list[list[tuple[SequenceState, int]]]
    mine: dict[Key, SequenceKV]
    next_seq_id: int
    next_request: int


def reconfigure(
    engine: Engine,
    target: int | ParallelLayout,
    kv_policy: KVPolicy = "migrate",
    plan: SwitchPlan | None = None,
) -> ReconfigReport:
    """Move `engine` to another TP layout mid-generation; every rank of the world calls it at
    once. `target` is a TP size looked up in the engine's GroupCache, or a layout from it.
    Unfinished samples keep their tokens, logprobs and generator states. With `plan` (a
    verdict's) each goes to the replica it names and migrates or recomputes its KV as it says;
    without, the planner's split places them (`derive_plan`) and `kv_policy` chooses. Bad
    targets raise before anything changes."""
    dst = target_layout(engine, target)
    check_target(engine, dst)
    _moving.add(engine)
    try:
        return _reconfigure(engine, dst, kv_policy, plan)
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


def _reconfigure(
    engine: Engine, dst: ParallelLayout, kv_policy: KVPolicy, plan: SwitchPlan | None
) -> ReconfigReport:
    src = engine.layout
    t0 = time.perf_counter()
    report = ReconfigReport(src.tp_size, dst.tp_size)
    big = dst if dst.tp_size > src.tp_size else src
    shared = _export(engine, src, big)
    t1 = time.perf_counter()
    report.groups_s = t1 - t0
    _reshard_weights(engine, src, dst, report)
    t_weights = time.perf_counter()
    engine.rebuild(dst)
    engine.advance_ids(shared.next_seq_id, shared.next_request)
    t2 = time.perf_counter()
    report.weights_s, report.cache_s = t_weights - t1, t2 - t_weights
    assign = _placement(shared.old, src, dst, big, plan)
    choose = _chooser(kv_policy, plan)
    moves, keep = _choose(engine, shared.old, assign, src, dst, choose, report)
    received = _reshard_kv(engine, shared.mine, moves, src, dst, report)
    report.kv_s = time.perf_counter() - t2
    engine.import_requests(_incoming(engine, shared.old, assign, keep, received, big, dst))
    report.total_s = time.perf_counter() - t0
    return report


def _export(engine: Engine, src: ParallelLayout, big: ParallelLayout) -> _Shared:
    """Everything unfinished leaves the engine; the old first ranks share the states (and the
    id counters) with every rank of the exchange group."""
    group = big.tp_group
    assert group is not None  # check_target
    size = dist.get_world_size(group)
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
    return _Shared(old, mine, max(g[1] for g in gathered), max(g[2] for g in gathered))


def _reshard_weights(
    engine: Engine, src: ParallelLayout, dst: ParallelLayout, report: ReconfigReport
) -> None:
    """Re-cut the weights in place. Out of TP 1 (a fold) each rank keeps its full weights
    unless told not to: it held them a moment ago, and the way back is then free."""
    keep_full = src.tp_size == 1 and engine.config.keep_full_weights
    stats: ReshardStats = reshard_(engine.model, src, dst, keep_full=keep_full)
    report.weight_bytes_received = stats.bytes_received
    report.weight_peak_bytes = stats.peak_bytes
    report.weight_bytes_before, report.weight_bytes_after = stats.bytes_before, stats.bytes_after


def _placement(
    old: list[list[tuple[SequenceState, int]]],
    src: ParallelLayout,
    dst: ParallelLayout,
    big: ParallelLayout,
    plan: SwitchPlan | None,
) -> dict[Key, int]:
    """Each sample's new replica, counted inside the exchange group: the plan's, or the
    planner's split of the group's samples (`derive_plan`). Raises where the plan misses a
    sample or names a replica outside the group (samples cannot leave it)."""
    size = big.tp_size
    old_base, new_base = big.dp_rank * (size // src.tp_size), big.dp_rank * (size // dst.tp_size)
    if plan is None:
        rows = [(old_base + j, _row(st, n)) for j, states in enumerate(old) for st, n in states]
        world = src.dp_size * src.tp_size
        plan = derive_plan(rows, _planner_layout(src, world), _planner_layout(dst, world))
    assign: dict[Key, int] = {}
    for states in old:
        for st, _ in states:
            key = (st.request_id, st.sample_index)
            if key not in plan.replica:
                raise ValueError(f"the switch plan has no replica for sample {key}")
            local = plan.replica[key] - new_base
            if not 0 <= local < size // dst.tp_size:
                raise ValueError(
                    f"the switch plan puts sample {key} on replica {plan.replica[key]}, outside "
                    f"the replicas [{new_base}, {new_base + size // dst.tp_size}) it can reach"
                )
            assign[key] = local
    return assign


def _planner_layout(layout: ParallelLayout, world: int) -> Layout:
    return Layout(dp=world // layout.tp_size, tp=layout.tp_size)


def _row(st: SequenceState, kv_len: int) -> Row:
    """A sample as a check reports it (no prompt hash: a derived split shares no prefix)."""
    generated = len(st.output_token_ids)
    context = len(st.prompt_token_ids) + generated
    return Row(
        st.request_id, st.sample_index, context, generated, st.params.max_tokens, kv_len > 0, 0
    )


def _chooser(kv_policy: KVPolicy, plan: SwitchPlan | None) -> Callable[[KVCost], KVChoice]:
    """Each sample's KV choice: the plan's, else `kv_policy`'s (checked)."""

    def choose(cost: KVCost) -> KVChoice:
        if plan is not None:
            key = (cost.request_id, cost.sample_index)
            return "recompute" if key in plan.recompute else "migrate"
        choice = kv_policy(cost) if callable(kv_policy) else kv_policy
        if choice not in ("migrate", "recompute"):
            raise ValueError(f"kv_policy returned {choice!r}; expected migrate or recompute")
        return choice

    return choose


def _choose(
    engine: Engine,
    old: list[list[tuple[SequenceState, int]]],
    assign: dict[Key, int],
    src: ParallelLayout,
    dst: ParallelLayout,
    choose: Callable[[KVCost], KVChoice],
    report: ReconfigReport,
) -> tuple[list[SequenceMove], dict[Key, tuple[tuple[int, ...], int]]]:
    """Per sample, identically on every rank: its cost, its choice, and for a migrated one its
    `SequenceMove` and (token ids, rows not sent) to import it with."""
    config = engine.model.config
    per_token = 2 * config.num_layers * config.head_dim * engine.cache.spec.dtype.itemsize
    moves: list[SequenceMove] = []
    keep: dict[Key, tuple[tuple[int, ...], int]] = {}
    # (old replica, new replica, prompt) -> tokens of KV the prompt's first migrated sample sent
    sent: dict[tuple[int, int, tuple[int, ...]], int] = {}
    block = engine.cache.spec.block_size if engine.config.enable_prefix_caching else 0
    for j_old, states in enumerate(old):
        for st, n in states:
            key = (st.request_id, st.sample_index)
            tokens = len(st.prompt_token_ids) + len(st.output_token_ids)
            move = SequenceMove(key, j_old, assign[key], n)
            crossing = heads_sent(move, src.tp_size, dst.tp_size, config.num_kv_heads)
            cost = KVCost(key[0], key[1], crossing * n * per_token, tokens)
            report.costs.append(cost)
            if n > 0 and choose(cost) == "migrate":
                prompt = (j_old, assign[key], tuple(st.prompt_token_ids))
                move = _skip_shared(move, sent, prompt, block)
                moves.append(move)
                keep[key] = (tuple(st.prompt_token_ids + st.output_token_ids[:-1]), move.skip)
                report.num_migrated += 1
            else:
                report.num_recomputed += 1
                report.tokens_recomputed += tokens
    return moves, keep


def _skip_shared(
    move: SequenceMove,
    sent: dict[tuple[int, int, tuple[int, ...]], int],
    prompt: tuple[int, int, tuple[int, ...]],
    block: int,
) -> SequenceMove:
    """A sample's move, without the prompt's full blocks when an earlier sample of the same
    prompt, old replica and new replica sent them (`sent`, updated): the receiver imports
    that one first, so its prefix cache holds them (`block` 0: no prefix cache, everything
    is sent). GRPO's n samples of a prompt share it, and the prompt is often most of every
    sample's KV. Local slices skip too, so every rank of the new group holds the same `first`
    for the sample and decides alike whether to import it or recompute."""
    n = move.num_tokens
    if not block or prompt not in sent:
        sent.setdefault(prompt, n)
        return move
    skip = min(len(prompt[2]), sent[prompt], n - 1) // block * block
    return dataclasses.replace(move, skip=skip)


def _reshard_kv(
    engine: Engine,
    mine: dict[Key, SequenceKV],
    moves: list[SequenceMove],
    src: ParallelLayout,
    dst: ParallelLayout,
    report: ReconfigReport,
) -> dict[Hashable, tuple[torch.Tensor, torch.Tensor]]:
    """The migrated samples' KV heads under `dst` (`tpreshard.reshard_kv`) of those this
    rank's new replica takes; the bytes moved go to `report`."""
    spec = engine.cache.spec
    shape = KVShape(
        spec.num_layers, engine.model.config.num_kv_heads, spec.head_dim, spec.dtype, spec.device
    )
    local: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {
        key: (kv.k, kv.v) for key, kv in mine.items()
    }
    traffic = KVReshardStats()
    out = reshard_kv(local, moves, src, dst, shape, traffic)
    report.kv_bytes_sent, report.kv_bytes_received = traffic.bytes_sent, traffic.bytes_received
    return out


def _incoming(
    engine: Engine,
    old: list[list[tuple[SequenceState, int]]],
    assign: dict[Key, int],
    keep: dict[Key, tuple[tuple[int, ...], int]],
    received: dict[Hashable, tuple[torch.Tensor, torch.Tensor]],
    big: ParallelLayout,
    dst: ParallelLayout,
) -> list[SequenceState]:
    """This rank's new replica's samples, in plan order, each with its KV where migrated."""
    total = engine.model.config.num_kv_heads
    start = head_range(total, dst.tp_rank, dst.tp_size)[0]
    my_replica = big.tp_rank // dst.tp_size
    incoming: list[SequenceState] = []
    for states in old:
        for st, _ in states:
            key = (st.request_id, st.sample_index)
            if assign[key] != my_replica:
                continue
            kv = None
            if key in keep:
                (k, v), (token_ids, skip) = received[key], keep[key]
                kv = SequenceKV(token_ids, k, v, start, total, skip)
            incoming.append(dataclasses.replace(st, kv=kv))
    return incoming


def _kv_len(st: SequenceState) -> int:
    return 0 if st.kv is None else st.kv.num_computed


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
