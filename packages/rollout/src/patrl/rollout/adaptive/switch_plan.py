"""The plan a switch runs: every unfinished sample's replica in the new layout and whether its
KV is migrated or recomputed (`SwitchPlan`), keyed by (request id, sample index) so every rank
applies the same one. A verdict carries the plan the planner priced (`plan_of`); a switch
without one derives the planner's assignment itself (`derive_plan`), so there is one split.
`running_set` is the planner's view of a check's rows, shared by both. See docs/adaptive_tp.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from patrl.lenpredict import Layout, RunningSet, assign_replicas, shared_prefix

# A sample, keyed as every rank of the world can name it: (request id, sample index)
Key = tuple[str, int]


class Row(NamedTuple):
    """One unfinished sample at a check, as every rank of the world sees it (it travels in the
    check's all-gather, so it holds plain values only)."""

    request_id: str
    sample_index: int
    context: int  # tokens in its KV once it runs: prompt + generated
    generated: int
    max_tokens: int
    has_kv: bool  # running, i.e. its KV is in the cache (a queued sample holds none)
    prompt_hash: int  # hash of its prompt's tokens: samples of one prompt share a prefill


@dataclass(frozen=True, slots=True)
class SwitchPlan:
    """Where each unfinished sample runs after a switch (its replica, i.e. DP index, in the
    target layout) and which samples recompute their KV (the rest migrate it). Covers every
    unfinished sample of the world at the moment of the switch."""

    replica: dict[Key, int]
    recompute: frozenset[Key] = frozenset()


def plan_of(
    rows: list[tuple[int, Row]], assignment: np.ndarray, recompute: frozenset[Key] = frozenset()
) -> SwitchPlan:
    """The plan of `rows` (each with its current replica, in the order `running_set` gave the
    planner) from the planner's `assignment` (a replica of the target layout per row)."""
    keys = [(row.request_id, row.sample_index) for _, row in rows]
    return SwitchPlan(
        {k: int(r) for k, r in zip(keys, assignment, strict=True)}, frozenset(recompute)
    )


def derive_plan(rows: list[tuple[int, Row]], src: Layout, dst: Layout) -> SwitchPlan:
    """The planner's assignment (`lenpredict.assign_replicas`) of `rows` from `src` to `dst`,
    each sample's work its remaining max_tokens (no length predicted); no recompute chosen."""
    if not rows:
        return SwitchPlan({})
    return plan_of(rows, assign_replicas(running_set(rows, 0), src, dst))


def running_set(rows: list[tuple[int, Row]], prefix_block: int) -> RunningSet:
    """The planner's view of `rows` (not empty), one row each in this order: its remaining
    length bounded by its max_tokens (one column, for predictions to replace), its request a
    group numbered in sorted request-id order, and (`prefix_block` > 0) the prompt tokens an
    earlier sample of its replica holds, which a fold sends once."""
    replica = np.array([dp for dp, _ in rows], dtype=int)
    request_ids, _, context, generated, max_tokens, has_kv, prompt = zip(
        *(row for _, row in rows), strict=True
    )
    context_, generated_ = np.array(context, dtype=int), np.array(generated, dtype=int)
    room = np.maximum(np.array(max_tokens, dtype=int) - generated_, 1)
    number = {r: k for k, r in enumerate(sorted(set(request_ids)))}
    holds = np.array(has_kv, dtype=bool)
    # samples of one prompt on a replica: a fold sends its full blocks once, with the first
    # of them that holds KV (queued ones send nothing)
    shared = np.zeros(len(rows), dtype=int)
    shared[holds] = shared_prefix(
        replica[holds],
        np.array(prompt, dtype=np.int64)[holds],
        (context_ - generated_)[holds],
        prefix_block,
    )
    return RunningSet(
        seq_ids=np.arange(len(rows)),
        replica=replica,
        context=context_,
        remaining=room[:, None].astype(float),
        has_kv=holds,
        group=np.array([number[r] for r in request_ids], dtype=int),
        shared=shared,
    )
