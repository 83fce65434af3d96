"""The speed of a speculating tail, for the planner and the simulator.

With speculative rollouts (patrl.rollout's drafter) a decode step of at most a few running
sequences verifies drafted tokens besides each sequence's own, and emits on average
`tokens_per_step` tokens a sequence. Such a step costs the decode step plus the latency
model's verify price (`LatencyModel.verify_s`: f for verifying at all, v per extra query
token). Per token of each sequence, a step of B sequences over C context tokens then costs

    t(B, C) / 1                                         where the step does not speculate
    (t(B, C) + f + v·d·B) / tokens_per_step             where it does (B <= `TailStep.max_batch`)

d being the drafted tokens a sequence verifies per step. The planner and the simulator count
time in token-steps (each sequence one token further), so pricing a token-step at this
`effective_step_time` prices the tail at its real speed; with no speculation (or acceptance 0)
every term is today's decode step, unchanged.

Where a step speculates: at the batches of at most the engine's `max_num_seqs` (the drafter's
cap) where it pays (f + v·d·B < (tokens_per_step − 1)·t(B, C)), checked at context 0 for every
batch from 1 up: the decode step only grows with context, so a batch that pays there pays at
any context (a conservative cut: the engine, deciding per step at the real context, may
speculate in a few larger steps too).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from patrl.lenpredict.latency_model import LatencyModel

__all__ = ["SpeculativeTail", "TailStep", "effective_step_time", "tail_steps"]

ACCEPTANCE_KEY = "rollout/spec_acceptance"
TOKENS_PER_STEP_KEY = "rollout/spec_tokens_per_step"


@dataclass(frozen=True, slots=True)
class SpeculativeTail:
    """How a run's speculating steps go: each sequence of a step that speculates emits
    `tokens_per_step` tokens and verifies `draft_tokens` drafted ones, on average; steps of at
    most `max_num_seqs` running sequences speculate (0: any). Invariant: 1 <= tokens_per_step
    <= 1 + draft_tokens (a step accepts no more than it drafted)."""

    tokens_per_step: float
    draft_tokens: float
    max_num_seqs: int = 16

    def __post_init__(self) -> None:
        if not 1.0 <= self.tokens_per_step <= 1.0 + self.draft_tokens + 1e-9:
            raise ValueError(
                f"tokens_per_step={self.tokens_per_step} must be in [1, 1 + draft_tokens] "
                f"with draft_tokens={self.draft_tokens}"
            )
        if self.max_num_seqs < 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 0 (0: every step)")

    @property
    def acceptance(self) -> float:
        """Accepted over drafted tokens (0 when nothing is drafted)."""
        if self.draft_tokens == 0:
            return 0.0
        return (self.tokens_per_step - 1.0) / self.draft_tokens

    def record(self) -> dict[str, float]:
        """JSON-ready, for reports."""
        return {
            "acceptance": self.acceptance,
            "tokens_per_step": self.tokens_per_step,
            "draft_tokens": self.draft_tokens,
            "max_num_seqs": float(self.max_num_seqs),
        }

    @classmethod
    def from_metrics(
        cls, rows: Iterable[Mapping[str, Any]], max_num_seqs: int = 16
    ) -> SpeculativeTail | None:
        """The tail a run's logged steps measured: the mean of `rollout/spec_acceptance` and
        of `rollout/spec_tokens_per_step` over the rows that have both (a row whose steps
        decoded nothing, tokens per step 0, is skipped); the drafted tokens per step follow,
        (tokens_per_step − 1) / acceptance. None when no row has them (the run did not
        speculate). The logged tokens per step count every decode step of a sample, the large
        batches that do not speculate too, so this is a lower bound on the tail's speed (and
        its drafts' price): the planner errs towards today's prices."""
        acceptance, tokens = [], []
        for row in rows:
            a, t = row.get(ACCEPTANCE_KEY), row.get(TOKENS_PER_STEP_KEY)
            if a is None or t is None or float(t) < 1.0:
                continue
            acceptance.append(float(a))
            tokens.append(float(t))
        if not tokens:
            return None
        alpha, tau = float(np.mean(acceptance)), float(np.mean(tokens))
        if alpha <= 0.0 or tau <= 1.0:
            return cls(1.0, 0.0, max_num_seqs)
        return cls(tau, (tau - 1.0) / alpha, max_num_seqs)

    @classmethod
    def from_metrics_log(cls, path: str | Path, max_num_seqs: int = 16) -> SpeculativeTail | None:
        """`from_metrics` of a run's `metrics.jsonl` (one JSON object a line)."""
        rows = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON metrics row: {e}") from e
        return cls.from_metrics(rows, max_num_seqs)

    @classmethod
    def from_acceptance(
        cls,
        acceptance: float,
        num_speculative_tokens: int,
        max_num_seqs: int = 16,
        adaptive: bool = True,
    ) -> SpeculativeTail:
        """The tail of a drafter that always finds a draft, whose accepted over drafted tokens
        (`acceptance`, as `rollout/spec_acceptance` logs it) is the given one. Its tokens are
        accepted each with one probability p, independently, until the first rejection: a
        draft of d tokens emits 1 + sum_{j<=d} p^j tokens. With `adaptive` (the drafter's
        default) d follows the drafter's rule (one more after a whole draft of full length,
        one past the accepted ones after a rejection, at most `num_speculative_tokens`),
        averaged over its stationary distribution; else d = `num_speculative_tokens`. p is
        solved for (accepted over drafted is below p: a rejection ends a draft). An upper
        bound on a real drafter, which sometimes finds no draft."""
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance={acceptance} must be in [0, 1]")
        k = num_speculative_tokens
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k} must be >= 1")
        lo, hi = 0.0, 1.0
        for _ in range(60):  # accepted / drafted rises with p, from 0 to 1
            p = (lo + hi) / 2
            tau, drafts = _draft_chain(p, k, adaptive)
            lo, hi = (p, hi) if (tau - 1.0) / drafts < acceptance else (lo, p)
        tau, drafts = _draft_chain((lo + hi) / 2, k, adaptive)
        return cls(tau, drafts, max_num_seqs)


def _draft_chain(p: float, k: int, adaptive: bool) -> tuple[float, float]:
    """(tokens per step, drafted tokens per step) of drafts of at most `k` tokens each
    accepted with probability `p` until the first rejection (`from_acceptance`)."""
    accepted = np.cumsum(p ** np.arange(1, k + 1))  # E[accepted | d], d = 1..k
    if not adaptive:
        return 1.0 + float(accepted[-1]), float(k)
    move = np.zeros((k, k))  # move[d - 1, e - 1]: the next step drafts e after d
    for d in range(1, k + 1):
        for j in range(d):  # j of d accepted, then a rejection
            move[d - 1, j] += p**j * (1.0 - p)
        move[d - 1, min(k, d + 1) - 1] += p**d
    system = np.vstack([move.T - np.eye(k), np.ones((1, k))])
    share, *_ = np.linalg.lstsq(system, np.r_[np.zeros(k), 1.0], rcond=None)
    share = np.clip(share, 0.0, None)
    share /= share.sum()
    return 1.0 + float(share @ accepted), float(share @ np.arange(1, k + 1))


@dataclass(frozen=True, slots=True)
class TailStep:
    """One TP size's speculating steps: a step of B <= `max_batch` sequences costs the decode
    step plus `fixed` plus `per_seq`·B and emits `tokens_per_step` tokens a sequence."""

    max_batch: int
    tokens_per_step: float
    fixed: float
    per_seq: float


def _verify_price(latency: LatencyModel, tp: int) -> tuple[float, float]:
    """(f, v): the fitted verify price when the profile has verify rows at `tp`; else each
    extra query token at the decode fit's cost of one more sequence (its per-sequence slope;
    its knees and context terms left out: the tail runs few sequences)."""
    if tp in latency.verify_s:
        return latency.verify_s[tp]
    return 0.0, latency.step_coefficients(tp).per_seq


def tail_steps(
    latency: LatencyModel, tail: SpeculativeTail | None, tp_sizes: Iterable[int], batch_cap: int
) -> dict[int, TailStep]:
    """Per TP size whose steps speculate somewhere, its `TailStep` (see the module docstring);
    TP sizes where no batch speculates are left out, so an empty dict is today's pricing.
    `batch_cap` bounds the batches looked at when the tail's own cap is 0 (any)."""
    if tail is None or tail.tokens_per_step <= 1.0:
        return {}
    cap = tail.max_num_seqs or batch_cap
    batch = np.arange(1, cap + 1, dtype=float)
    out = {}
    for tp in tp_sizes:
        fixed, per_token = _verify_price(latency, tp)
        per_seq = per_token * tail.draft_tokens
        decode = latency.step_time(tp, batch, np.zeros_like(batch))
        pays = fixed + per_seq * batch < (tail.tokens_per_step - 1.0) * decode
        limit = int(np.argmin(pays)) if not pays.all() else cap  # first batch that does not
        if limit:
            out[tp] = TailStep(limit, tail.tokens_per_step, fixed, per_seq)
    return out


def effective_step_time(
    latency: LatencyModel,
    step: TailStep | None,
    tp: int,
    batch: np.ndarray | float,
    context_tokens: np.ndarray | float,
    max_context: np.ndarray | float | None = None,
) -> np.ndarray:
    """Seconds per token-step (each of `batch` sequences one token further) at TP size `tp`:
    `LatencyModel.step_time`, or where `step` speculates at this batch, the verify step's
    time over its tokens per sequence. Vectorised as `step_time` is."""
    plain = latency.step_time(tp, batch, context_tokens, max_context)
    if step is None:
        return plain
    b = np.asarray(batch, dtype=float)
    spec = (plain + step.fixed + step.per_seq * b) / step.tokens_per_step
    return np.asarray(np.where(b <= step.max_batch, spec, plain))
