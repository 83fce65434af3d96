"""Time to finish: how long the running sequences take to complete in a layout.

A replica's time is the sum of its decode steps until its last sequence finishes (each priced by
the latency model); a layout's is its slowest replica's. No step loop: a sequence with r steps
left is alive exactly r steps and its context grows one a step, so the terms linear in batch
and context are closed-form sums; only the knees' and padded-context terms depend on which
sequences are alive together, summed over the segments between finishes, and only when the
latency model has them. Many questions (layouts, scenarios, delays) go in one vectorised pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from patrl.lenpredict.latency_model import StepCoefficients
from patrl.lenpredict.layout import Layout
from patrl.lenpredict.speculation import TailStep


@dataclass(slots=True)
class RunningSet:
    """The unfinished sequences, as parallel arrays (one row per sequence)."""

    seq_ids: np.ndarray  # int
    replica: np.ndarray  # int, replica of the current layout holding the sequence
    context: np.ndarray  # int, prompt + generated tokens
    remaining: np.ndarray  # float (n, Q), predicted remaining-length quantiles
    # False for sequences still queued (no KV yet): a switch moves nothing of theirs
    has_kv: np.ndarray | None = None
    # int, the request of each sequence: a split moves requests whole, as the engine does
    # (None: every sequence on its own)
    group: np.ndarray | None = None
    # int, tokens at the start of each sequence's context that an earlier sequence of its
    # replica also holds (its prompt's full KV blocks, `shared_prefix`): merging replicas
    # sends them once for the lot, as the engine's reconfigure does (None: nothing shared)
    shared: np.ndarray | None = None
    # float, the most tokens each sequence can still generate (max_tokens less what it has):
    # caps independent draws of its remaining length (None: no cap known)
    max_remaining: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.seq_ids)
        if self.remaining.ndim != 2 or self.remaining.shape[0] != n:
            raise ValueError(f"remaining must have shape ({n}, Q), got {self.remaining.shape}")
        if len(self.replica) != n or len(self.context) != n:
            raise ValueError(
                f"seq_ids/replica/context lengths differ: {n}/{len(self.replica)}/{len(self.context)}"
            )
        if self.group is not None and len(self.group) != n:
            raise ValueError(f"group has {len(self.group)} entries for {n} sequences")
        if self.shared is not None and len(self.shared) != n:
            raise ValueError(f"shared has {len(self.shared)} entries for {n} sequences")
        if self.max_remaining is not None and len(self.max_remaining) != n:
            raise ValueError(
                f"max_remaining has {len(self.max_remaining)} entries for {n} sequences"
            )

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def holds_kv(self) -> np.ndarray:
        return np.ones(len(self), dtype=bool) if self.has_kv is None else self.has_kv


def shared_prefix(
    replica: np.ndarray, prompt: np.ndarray, prompt_tokens: np.ndarray, block_size: int
) -> np.ndarray:
    """`RunningSet.shared` of sequences on `replica` whose prompts are `prompt` (any id, equal
    for equal prompts) of `prompt_tokens` tokens: the first sequence of each (replica, prompt)
    shares nothing, every later one its prompt's full blocks (`block_size` 0: no prefix
    cache, nothing shared)."""
    replica, prompt = np.asarray(replica), np.asarray(prompt)
    if not block_size or not len(replica):
        return np.zeros(len(replica), dtype=int)
    pairs = np.stack([replica, prompt], axis=1)
    _, first = np.unique(pairs, axis=0, return_index=True)
    shared = np.asarray(prompt_tokens, dtype=int) // block_size * block_size
    shared[first] = 0
    return shared


def independent_draws(
    remaining: np.ndarray,
    levels: np.ndarray,
    draws: int,
    rng: np.random.Generator,
    cap: np.ndarray | None = None,
) -> np.ndarray:
    """(n, draws) remaining lengths, each sequence's drawn independently of the others' from
    the distribution its quantiles `remaining` (n, Q) at `levels` (Q,) describe: linear between
    the quantiles, exponential tails beyond the outer ones (rates from the two outermost
    quantiles of each side), at least 1 token and at most `cap` (n,) when given.

    Why: a rollout ends with the longest of its sequences, and the longest of many independent
    samples lies far above any one's median; comonotone quantile scenarios (every sequence at
    its q-quantile at once) put it no higher than the highest quantile."""
    levels = np.asarray(levels, dtype=float)
    q = np.maximum(np.asarray(remaining, dtype=float), 1.0)
    n, k = q.shape
    if k != len(levels) or k < 2:
        raise ValueError(
            f"independent draws need >= 2 quantile columns at the given levels; got {k} "
            f"columns for levels {levels.tolist()}"
        )
    u = rng.random((n, draws))
    j = np.clip(np.searchsorted(levels, u), 1, k - 1)  # the quantiles bracketing each u
    rows = np.arange(n)[:, None]
    left, right = q[rows, j - 1], q[rows, j]
    t = (u - levels[j - 1]) / (levels[j] - levels[j - 1])
    out = left + (right - left) * t
    lo, hi = levels[0], levels[-1]
    # exponential tails: S(x) = (1 - hi)·exp(-(x - q_hi)/θ) above, F(x) = lo·exp((x - q_lo)/θ')
    theta_hi = np.maximum(q[:, -1] - q[:, -2], 1.0) / np.log((1 - levels[-2]) / (1 - hi))
    theta_lo = np.maximum(q[:, 1] - q[:, 0], 1.0) / np.log(levels[1] / lo)
    above, below = u > hi, u < lo
    out = np.where(
        above, q[:, -1:] + theta_hi[:, None] * np.log((1 - hi) / np.maximum(1 - u, 1e-12)), out
    )
    out = np.where(below, q[:, :1] + theta_lo[:, None] * np.log(np.maximum(u, 1e-12) / lo), out)
    out = np.maximum(out, 1.0)
    if cap is not None:
        out = np.minimum(out, np.maximum(np.asarray(cap, dtype=float), 1.0)[:, None])
    return out


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
    step_coefficients: dict[int, StepCoefficients],
    tail: Mapping[int, TailStep] | None = None,
) -> np.ndarray:
    """Seconds of each row's slowest replica (see `Questions`), shape (rows,). `assignments`
    holds one replica-per-sequence array per assignment index; `step_coefficients` maps a TP
    size to `LatencyModel.step_coefficients`. `tail` (patrl.lenpredict.speculation.tail_steps)
    maps a TP size whose small steps speculate to their price: a replica's steps from the
    moment at most `max_batch` of its sequences are left (its tail) are priced as
    `effective_step_time` prices them, per token-step; None or empty: every step plain."""
    assign, column = np.asarray(rows.assign), np.asarray(rows.column)
    delay, shift = np.asarray(rows.delay, dtype=float), np.asarray(rows.shift)
    original = running.remaining.T[column]  # (R, n)
    skip = np.where(shift, delay, 0.0)[:, None]  # steps already done, when shifting
    stop = np.where(shift, np.inf, delay)[:, None]  # steps to time, when clipping
    rem = np.minimum(np.maximum(original - skip, 0.0), stop)
    ctx = running.context + np.minimum(original, skip)
    dp = np.asarray(rows.dp)
    offset = np.cumsum(dp) - dp
    groups = int(offset[-1] + dp[-1])
    key = (offset[:, None] + assignments[assign]).ravel()
    coefs = [step_coefficients[tp] for tp in rows.tp]
    a, b, c, e = np.array([k[:4] for k in coefs]).repeat(dp, axis=0).T
    knee, change = _knee_arrays(coefs, dp)
    # a knee matters only where a replica runs more sequences than it at once (its slope
    # change may be negative: on a CPU, past a few sequences each costs less)
    lowest = knee.min(initial=np.inf)
    crowded = len(running) > lowest and np.bincount(key, minlength=groups).max() > lowest

    def plain(rem: np.ndarray, ctx: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per replica: seconds of its plain steps, how many there are, Σ of their batches."""
        # per replica: the steps of each sequence, and its context summed over them
        weights = np.concatenate([rem.ravel(), (rem * (ctx + (rem - 1) / 2)).ravel()])
        sums = np.bincount(np.concatenate([key, key + groups]), weights, minlength=2 * groups)
        longest = np.zeros(groups)
        np.maximum.at(longest, key, rem.ravel())
        seconds = a * longest + b * sums[:groups] + c * sums[groups:]
        if crowded or (e != 0).any():
            past_knee, padded = _ordered_terms(rows, running, rem, ctx, key, knee)
            seconds += (change * past_knee).sum(axis=1) + e * padded
        return seconds, longest, sums[:groups]

    per_replica, _, _ = plain(rem, ctx)
    limit = np.array([tail[tp].max_batch if tail and tp in tail else 0 for tp in rows.tp])
    if limit.any():
        # the tail: from the (limit + 1)-th longest's finish on, a question of its own (the
        # running set shifted by that many steps), priced plain and then as it speculates
        start = _tail_start(rows, running, rem, key, limit.repeat(dp))[key].reshape(rem.shape)
        tail_rem = np.maximum(rem - start, 0.0)
        seconds, steps, batches = plain(tail_rem, ctx + start)
        spec = [tail[tp] if tail and tp in tail else None for tp in rows.tp]
        tau, fixed, per_seq = (
            np.array(
                [
                    (1.0, 0.0, 0.0) if s is None else (s.tokens_per_step, s.fixed, s.per_seq)
                    for s in spec
                ]
            )
            .repeat(dp, axis=0)
            .T
        )
        speculating = (seconds + fixed * steps + per_seq * batches) / tau
        per_replica = np.where(
            limit.repeat(dp) > 0, per_replica - seconds + speculating, per_replica
        )
    return np.maximum.reduceat(per_replica, offset)


def _tail_start(
    rows: Questions, running: RunningSet, rem: np.ndarray, key: np.ndarray, limit: np.ndarray
) -> np.ndarray:
    """Per replica (as `key` numbers them; `limit` per replica too): the steps after which at
    most `limit` of its sequences are left, the (limit + 1)-th longest remaining length (0
    when it holds no more than `limit`). One sort, as `_ordered_terms` makes it."""
    count, n = rem.shape
    groups = len(limit)
    order = np.argsort(-running.remaining, axis=0).T[np.asarray(rows.column)]  # (R, n)
    flat = (np.arange(count)[:, None] * n + order).ravel()
    idx = flat[np.argsort(key[flat], kind="stable")]
    keys, lengths = key[idx], rem.ravel()[idx]
    sizes = np.bincount(keys, minlength=groups)
    rank = np.arange(len(keys)) - (np.cumsum(sizes) - sizes)[keys] + 1
    start = np.zeros(groups)
    hit = rank == limit[keys] + 1
    start[keys[hit]] = lengths[hit]
    return start


def _knee_arrays(coefs: list[StepCoefficients], dp: np.ndarray) -> tuple[np.ndarray, ...]:
    """Knees and slope changes per replica, shape (replicas, most knees of any row); rows
    with fewer knees are padded with a knee no batch reaches and a change of 0."""
    width = max(len(k.knees) for k in coefs)
    knee = np.full((len(coefs), width), 1e300)
    change = np.zeros((len(coefs), width))
    for i, k in enumerate(coefs):
        knee[i, : len(k.knees)] = k.knees
        change[i, : len(k.knees)] = k.slope_changes
    return knee.repeat(dp, axis=0), change.repeat(dp, axis=0)


def _ordered_terms(
    rows: Questions,
    running: RunningSet,
    rem: np.ndarray,
    ctx: np.ndarray,
    key: np.ndarray,
    knee: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per replica (as `key` numbers them): Σ_steps max(0, B − knee) for each of its knees
    (`knee` is (replicas, knees); the result too) and Σ_steps B·M.

    In a replica's order of remaining length, longest first (r_1 >= r_2 >= ..), exactly k
    sequences are alive for the r_k − r_{k+1} steps after the (k+1)-th finishes, and the
    longest context among them at the start is P_k, the running maximum of the contexts. By
    summation by parts Σ_k (r_k − r_{k+1})·f(k) = Σ_k r_k·(f(k) − f(k−1)), so each sequence's
    share needs only its rank k in its replica and P_k, P_{k−1}. The order: one sort of each
    quantile column (clipping or shifting keeps it), then a stable sort by replica (radix, on
    16-bit keys)."""
    count, n = rem.shape
    groups = len(knee)
    order = np.argsort(-running.remaining, axis=0).T[np.asarray(rows.column)]  # (R, n)
    flat = (np.arange(count)[:, None] * n + order).ravel()
    narrow = key[flat].astype(np.int16 if groups < 2**15 else np.int64)
    idx = flat[np.argsort(narrow, kind="stable")]
    key, rem, ctx = key[idx], rem.ravel()[idx], ctx.ravel()[idx]
    sizes = np.bincount(key, minlength=groups)
    first = np.cumsum(sizes) - sizes
    rank = np.arange(len(key)) - first[key] + 1
    # running maximum within each replica: lift every replica above the ones before it
    lift = key * (ctx.max() + 1.0)
    upto = np.maximum.accumulate(ctx + lift) - lift
    before = np.r_[0.0, upto[:-1]]  # P_{k-1}; at a replica's first (k = 1) it has weight 0
    # B·M = B·(longest context at the start) + B·(steps since): the second part is Σ r(r−1)/2
    padded = rem * (rank * upto - (rank - 1) * before + (rem - 1) / 2)
    past_knee = np.zeros(knee.shape)  # no columns when only the padded term brought us here
    for j, k in enumerate(knee.T):
        past_knee[:, j] = np.bincount(
            key, weights=rem * np.clip(rank - k[key], 0.0, 1.0), minlength=groups
        )
    return past_knee, np.bincount(key, weights=padded, minlength=groups)
