"""The most adaptive TP can ever gain over the better of two static layouts, on a latency
model, whatever the workload: "is there a crossover here worth folding for?".

A rollout is a sequence of decode steps; each step runs some number of sequences, so a
workload is, for this question, how many steps it spends at each batch size (its context
per sequence held fixed). Static layout L costs S_L = Σ_b w_b·s_L(b), with w_b the steps at
batch b and s_L the model's step time (`dp` replicas of ⌈b/dp⌉ sequences each, in parallel:
the balance every static layout would wish for). An ideal adaptive policy, switching for
free at every step, costs A = Σ_b w_b·min_L s_L(b). The ceiling is

    min over workloads w ≥ 0 of  A(w) / min(S_wide(w), S_narrow(w)).

The ratio does not change when w is scaled, so fix min(S_wide, S_narrow) = 1: minimise the
linear A subject to S_wide ≥ 1 and S_narrow ≥ 1, a linear programme with two constraints.
Its optimum sits on a vertex, where at most two batch sizes have steps: the workload that
most favours adaptive spends part of its steps at one batch size where the wide layout is
faster and the rest at one where the narrow layout is faster, in the proportion that makes
both static layouts tie. Every pair is tried (max_batch² of them). Real policies pay their
switches, balance replicas imperfectly and predict lengths, so a measured ratio below the
ceiling means the latency model is wrong, not that the policy is good.

`lockstep_free_switch` estimates the same for one workload (its samples' lengths and
replicas), its replicas stepping in lockstep. An estimate, not a bound: a static layout's
replicas run apart, each at its own pace, which lockstep overprices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from patrl.lenpredict.latency_model import LatencyModel
from patrl.lenpredict.layout import Layout


@dataclass(frozen=True, slots=True)
class Ceiling:
    """The ceiling, and the two-batch workload that attains it."""

    ratio: float  # ideal adaptive / best static, at the workload below; 1.0: no crossover
    wide_batch: int  # the batch size of the steps where `wide` is faster (0: none)
    narrow_batch: int  # ... where `narrow` is faster (0: none)
    wide_share: float  # share of the workload's steps at wide_batch


def step_times(
    latency: LatencyModel, layout: Layout, batches: np.ndarray, context_per_seq: float
) -> np.ndarray:
    """Seconds of one decode step of `batches` sequences (each of `context_per_seq` tokens)
    spread evenly over the layout's replicas."""
    per_replica = np.ceil(np.asarray(batches, dtype=float) / layout.dp)
    return latency.step_time(
        layout.tp,
        per_replica,
        per_replica * context_per_seq,
        np.full_like(per_replica, context_per_seq),
    )


def adaptive_ceiling(
    latency: LatencyModel,
    wide: Layout,
    narrow: Layout,
    max_batch: int,
    context_per_seq: float,
) -> Ceiling:
    """The ceiling of the module docstring over batch sizes 1..max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}: needs at least one sequence")
    if wide.world_size != narrow.world_size:
        raise ValueError(f"layouts {wide} and {narrow} span different numbers of ranks")
    batches = np.arange(1, max_batch + 1)
    w = step_times(latency, wide, batches, context_per_seq)
    n = step_times(latency, narrow, batches, context_per_seq)
    best = np.minimum(w, n)
    wide_wins = np.flatnonzero(w < n)
    narrow_wins = np.flatnonzero(n < w)
    ceiling = Ceiling(1.0, 0, 0, 0.0)
    if not len(wide_wins) or not len(narrow_wins):
        return ceiling
    # steps x at batch i (wide faster) and y at batch j (narrow faster) with both statics
    # costing 1: x·w_i + y·w_j = 1 and x·n_i + y·n_j = 1; then A = x·best_i + y·best_j
    i, j = np.meshgrid(wide_wins, narrow_wins, indexing="ij")
    det = w[i] * n[j] - w[j] * n[i]
    x = (n[j] - w[j]) / det
    y = (w[i] - n[i]) / det
    ratio = x * best[i] + y * best[j]  # x, y > 0: det < 0 and both numerators negative
    k = np.unravel_index(int(np.argmin(ratio)), ratio.shape)
    if ratio[k] < ceiling.ratio:
        share = float(x[k] / (x[k] + y[k]))
        ceiling = Ceiling(float(ratio[k]), int(batches[i[k]]), int(batches[j[k]]), share)
    return ceiling


@dataclass(frozen=True, slots=True)
class LockstepFreeSwitch:
    """Decode seconds of one workload, its replicas in lockstep, at two layouts and switching
    between them for free."""

    wide_s: float  # at `wide` throughout
    narrow_s: float  # at `narrow` throughout
    free_s: float  # at whichever is faster, step by step, switches free

    @property
    def ratio(self) -> float:
        """Free switching over the better static layout (1.0: nothing gained, or nothing to
        decode)."""
        best = min(self.wide_s, self.narrow_s)
        return self.free_s / best if best > 0 else 1.0


def lockstep_free_switch(
    latency: LatencyModel,
    wide: Layout,
    narrow: Layout,
    lengths: np.ndarray,
    prompt_tokens: np.ndarray,
    replica: np.ndarray,
) -> LockstepFreeSwitch:
    """What switching for free at every step would take on one workload, on the latency
    model, where `adaptive_ceiling` takes the worst workload of all: every sample admitted at
    once and decoding in lockstep, sample i for lengths[i] - 1 steps (its first token comes
    from the prefill) at a context of prompt_tokens[i] + the steps so far, on replica[i] of
    `wide` and, merged, on replica[i] // (wide.dp // narrow.dp) of `narrow`. A layout's step
    takes its slowest replica's; prefills and switches are left out. Not a bound on what a
    policy can measure: a static layout's replica runs at its own pace, never waiting for the
    slowest one at every step. Where the estimate sits far above a target, though, the
    workload leaves any policy little room."""
    if wide.world_size != narrow.world_size or wide.dp % narrow.dp or narrow.tp % wide.tp:
        raise ValueError(f"{narrow} does not merge replicas of {wide}")
    lengths = np.asarray(lengths, dtype=int)
    prompt_tokens = np.asarray(prompt_tokens, dtype=int)
    replica = np.asarray(replica, dtype=int)
    if not (len(lengths) == len(prompt_tokens) == len(replica)) or not len(lengths):
        raise ValueError(
            f"lengths, prompt_tokens and replica: one entry per sample, got "
            f"{len(lengths)}, {len(prompt_tokens)}, {len(replica)}"
        )
    if replica.min() < 0 or replica.max() >= wide.dp:
        raise ValueError(f"replica indices must lie in [0, {wide.dp}), got {sorted(set(replica))}")
    steps = np.arange(1, max(int(lengths.max()), 2))  # decode step s: samples with length > s
    totals = []
    for layout, of in ((wide, replica), (narrow, replica // (wide.dp // narrow.dp))):
        worst = np.zeros(len(steps))
        for r in range(layout.dp):
            mine = of == r
            if not mine.any():
                continue
            # this replica's samples, longest first: those alive at step s are a prefix
            order = np.argsort(-lengths[mine], kind="stable")
            length, prompt = lengths[mine][order], prompt_tokens[mine][order]
            alive = np.searchsorted(-length, -steps, side="left")  # count with length > s
            prompts_sum = np.r_[0, np.cumsum(prompt)][alive]
            longest_prompt = np.r_[0, np.maximum.accumulate(prompt)][alive]
            busy = alive > 0
            t = latency.step_time(
                layout.tp,
                alive[busy],
                prompts_sum[busy] + alive[busy] * steps[busy],
                longest_prompt[busy] + steps[busy],
            )
            worst[busy] = np.maximum(worst[busy], t)
        totals.append(worst)
    return LockstepFreeSwitch(
        float(totals[0].sum()), float(totals[1].sum()), float(np.minimum(*totals).sum())
    )
