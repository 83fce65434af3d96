"""The candidate plans the planner prices: a target layout, where each sequence runs in it,
and whether each sequence's KV is migrated or recomputed (`Option`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from patrl.lenpredict.assignment import split_replicas
from patrl.lenpredict.finish_time import Questions, RunningSet
from patrl.lenpredict.layout import Layout

__all__ = ["Option", "assign_replicas", "delay_steps", "plan_questions"]


@dataclass(slots=True)
class Option:
    """One priced plan: switch to `layout` (the current one: stay), its run and overhead."""

    layout: Layout
    run_s: float  # predicted time to finish in this layout after switching now
    overhead_s: float  # predicted cost of switching to it now (0 for the current layout)
    later_s: float  # best predicted total when switching to it after some steps (inf: none)
    later_steps: int  # after how many steps that best delayed switch happens
    assignment: np.ndarray  # replica of each sequence in this layout
    migrate: np.ndarray  # bool per sequence: migrate its KV (True) or recompute it (False)
    # a split at the rollout's first call: the best predicted total when splitting now and
    # folding back to the current layout after `round_trip_steps` steps, both switches'
    # overheads included (inf: not priced)
    round_trip_s: float = np.inf
    round_trip_steps: int = 0

    @property
    def now_s(self) -> float:
        return self.run_s + self.overhead_s


def assign_replicas(running: RunningSet, src: Layout, dst: Layout) -> np.ndarray:
    """Replica of each sequence in `dst`. Growing TP merges whole replicas (sequences stay on
    the ranks that hold them); shrinking splits each replica's requests (`RunningSet.group`;
    else its sequences) whole over its children by `split_replicas` of their mean predicted
    remaining work, the split a reconfigure runs."""
    if dst.tp >= src.tp:
        return running.replica // (dst.tp // src.tp)
    split = src.tp // dst.tp
    work = running.remaining.mean(axis=1)
    if running.group is None:
        return running.replica * split + split_replicas(running.replica, work, split)
    # a unit per (replica, request), its work the sum of its sequences'
    stride = int(running.group.max()) + 1
    units, unit_of = np.unique(
        running.replica.astype(np.int64) * stride + running.group, return_inverse=True
    )
    unit_work = np.bincount(unit_of, weights=work, minlength=len(units))
    child = split_replicas(units // stride, unit_work, split)[unit_of]
    return running.replica * split + child


def delay_steps(median: np.ndarray, levels: tuple[float, ...]) -> np.ndarray:
    """Steps after which a delayed switch is priced: when the fractions `levels` of the
    sequences are predicted finished (`median` remaining lengths); positive, sorted, unique."""
    at = [int(level * (len(median) - 1)) for level in levels]
    if not at:
        return np.zeros(0)
    delays = {float(d) for d in np.floor(np.partition(median, at)[at])}
    return np.array(sorted(d for d in delays if d > 0))


def plan_questions(
    current: Layout,
    targets: list[Layout],
    scenarios: int,
    delays: np.ndarray,
    trips: list[int],
    med: int | None = None,
) -> Questions:
    """The finish times `decide` prices, in this order: staying (every scenario column);
    switching now to each target (every scenario column); the steps before a delayed switch,
    then each target's steps after it (median column `med`, by default the middle one); for
    the splits `trips` (indices into `targets`), their steps before folding back, then the
    current layout's after."""
    med = scenarios // 2 if med is None else med
    rows = Questions()
    for col in range(scenarios):
        rows.add(0, col, False, np.inf, current)
    for j, target in enumerate(targets, start=1):
        for col in range(scenarios):
            rows.add(j, col, True, 0.0, target)
    for delay in delays:
        rows.add(0, med, False, delay, current)
    for j, target in enumerate(targets, start=1):
        for delay in delays:
            rows.add(j, med, True, delay, target)
    for j in trips:
        for delay in delays:
            rows.add(j + 1, med, False, delay, targets[j])
    if trips:
        for delay in delays:
            rows.add(0, med, True, delay, current)
    return rows
