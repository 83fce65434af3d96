"""Time to finish: how long the running sequences take to complete in a layout.

A replica's time is a sum over the segments between consecutive predicted finishes: while
`alive` sequences remain, each step costs `step_time(tp, alive, context)`, and the context
grows by one token per alive sequence per step. The latency model is linear in context, so a
segment's mean context gives its exact sum. A layout's time is that of its slowest replica.

Many such questions (layouts, quantile scenarios, delays) are answered in one vectorised pass,
because the planner asks them on the engine's hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from patrl.lenpredict.layout import Layout


@dataclass(slots=True)
class RunningSet:
    """The unfinished sequences, as parallel arrays (one row per sequence)."""

    seq_ids: np.ndarray  # int
    replica: np.ndarray  # int, replica of the current layout holding the sequence
    context: np.ndarray  # int, prompt + generated tokens
    remaining: np.ndarray  # float (n, Q), predicted remaining-length quantiles
    # False for sequences still queued (no KV yet): a switch moves nothing of theirs
    has_kv: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.seq_ids)
        if self.remaining.ndim != 2 or self.remaining.shape[0] != n:
            raise ValueError(f"remaining must have shape ({n}, Q), got {self.remaining.shape}")
        if len(self.replica) != n or len(self.context) != n:
            raise ValueError(
                f"seq_ids/replica/context lengths differ: {n}/{len(self.replica)}/{len(self.context)}"
            )

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def holds_kv(self) -> np.ndarray:
        return np.ones(len(self), dtype=bool) if self.has_kv is None else self.has_kv


@dataclass(slots=True)
class Questions:
    """A batch of finish-time questions, one per row, answered by one vectorised pass: under
    assignment `assign` (an index), quantile column `column`, remaining lengths clipped at
    `delay` (how long the first `delay` steps take) or shifted by it (how long the rest takes
    after `delay` steps), in a layout of `tp` and `dp`."""

    assign: list[int] = field(default_factory=list)
    column: list[int] = field(default_factory=list)
    shift: list[bool] = field(default_factory=list)
    delay: list[float] = field(default_factory=list)
    tp: list[int] = field(default_factory=list)
    dp: list[int] = field(default_factory=list)

    def add(self, assign: int, column: int, shift: bool, delay: float, layout: Layout) -> None:
        self.assign.append(assign)
        self.column.append(column)
        self.shift.append(shift)
        self.delay.append(delay)
        self.tp.append(layout.tp)
        self.dp.append(layout.dp)


def slowest_replica_times(
    rows: Questions,
    assignments: np.ndarray,
    running: RunningSet,
    step_coefficients: dict[int, tuple[float, float, float, float, float]],
) -> np.ndarray:
    """Seconds of each row's slowest replica (see `Questions`), shape (rows,). `assignments`
    holds one replica-per-sequence array per assignment index; `step_coefficients` maps a TP
    size to `LatencyModel.step_coefficients`."""
    n, q = running.remaining.shape
    columns = running.remaining.T  # (Q, n)
    # one order per (assignment, column): by replica, then remaining; clipping or shifting
    # the remaining lengths keeps it
    keys = assignments[:, None, :] * (columns.max() + 1.0) + columns[None, :, :]
    orders = np.argsort(keys.reshape(-1, n), axis=1)
    assign, column = np.asarray(rows.assign), np.asarray(rows.column)
    order = orders[assign * q + column]  # (R, n)
    original = columns[column[:, None], order]
    delay = np.asarray(rows.delay)
    shift = np.asarray(rows.shift)
    skip = np.where(shift, delay, 0.0)[:, None]  # steps already done, when shifting
    stop = np.where(shift, np.inf, delay)[:, None]  # steps to time, when clipping
    rem = np.minimum(np.maximum(original - skip, 0.0), stop)
    ctx = running.context[order] + np.minimum(original, skip)
    dp = np.asarray(rows.dp)
    offset = np.r_[0, np.cumsum(dp)[:-1]]
    key = (offset[:, None] + assignments[assign[:, None], order]).ravel()
    groups = int(dp.sum())
    counts = np.bincount(key, minlength=groups)
    ends = np.cumsum(counts)
    end = ends[key]
    here = np.arange(key.size)
    alive = (end - here).reshape(rem.shape)
    prev = np.empty(rem.shape)
    prev[:, 0] = 0.0
    prev[:, 1:] = rem[:, :-1]
    prev.ravel()[(ends - counts)[counts > 0]] = 0.0  # each replica starts from now
    prefix = np.zeros(key.size + 1)
    np.cumsum(ctx, out=prefix[1:])
    ahead = (prefix[end] - prefix[here]).reshape(rem.shape)  # context of the alive ones
    context_mid = np.maximum(ahead + alive * (prev + rem - 1) / 2, 0.0)
    a, b, c, d, knee = np.array([step_coefficients[tp] for tp in rows.tp]).T[:, :, None]
    step = a + b * alive + c * context_mid + d * np.maximum(0.0, alive - knee)
    step = (step * (rem - prev)).ravel()
    per_replica = np.bincount(key, weights=step, minlength=groups)
    return np.maximum.reduceat(per_replica, offset)
