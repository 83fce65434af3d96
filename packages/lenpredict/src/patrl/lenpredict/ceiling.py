"""The most adaptive TP can ever gain over the better of two static layouts, on a latency
model, whatever the workload (`adaptive_ceiling`).

A workload is the steps it spends at each batch size: static layout L costs Σ_b w_b·s_L(b), a
free-switching adaptive policy Σ_b w_b·min_L s_L(b). Minimising their ratio over w is a linear
programme whose optimum uses at most two batch sizes, so every pair is tried. A measured ratio
below this ceiling means the latency model is wrong, not that the policy is good.
`lockstep_free_switch` estimates the same for one workload, its replicas in lockstep (an
estimate, not a bound). See docs/adaptive_tp.md.
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
