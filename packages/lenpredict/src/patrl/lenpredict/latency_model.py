"""Step, prefill, collective and reconfiguration costs, fitted from a `Profile`.

Decode step, per TP size: t(B, C, M) = a + b·B + c·C + e·B·M + Σ_k d_k·max(0, B − knee_k), B
running sequences, C their total context, M the longest one's; the padded term e (a backend that
gathers blocks padded to the longest) and up to two knees are kept only when cross-validation
says they predict held-out rows better. Coefficients are fitted on relative error (the planner
compares ratios of times) and the slope never drops below zero. Prefill of sequences of T_i
tokens: a + Σ_i (s + b·T_i + c·T_i²). A speculative verify step of B sequences carrying Q query
tokens in all: the decode step's t(B, C) + f + v·(Q − B), f, v ≥ 0 fitted on the verify rows'
excess over the decode fit (f: what verifying costs at all, v: each extra token). Collectives: α + bytes/β per (op, group size).
See docs/adaptive_tp.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from patrl.lenpredict.profile_schema import (
    CollectiveRow,
    DecodeRow,
    ModelInfo,
    PrefillRow,
    Profile,
    SwitchRow,
    VerifyRow,
)


def _nonneg_relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min Σ((x·c − y)/y)² subject to c ≥ 0, by dropping the most negative coefficient and
    refitting (an active set that is exact for the few features used here)."""
    w = x / y[:, None]
    target = np.ones(len(y))
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    while active.any():
        sol, *_ = np.linalg.lstsq(w[:, active], target, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        idx = np.flatnonzero(active)[np.argmin(sol)]
        active[idx] = False
    return coef


def _mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.median(np.abs(pred - y) / y))


ContextForm = Literal["total", "padded", "both"]
# which context columns each form fits (the others are zeroed): total C, padded B·M
_FORM_MASK: dict[str, tuple[float, float]] = {
    "total": (1.0, 0.0),
    "padded": (0.0, 1.0),
    "both": (1.0, 1.0),
}


MAX_KNEES = 2


def _decode_features(
    batch: np.ndarray,
    context: np.ndarray,
    padded: np.ndarray,
    knees: tuple[float, ...],
    form: str,
    bends: tuple[float, ...],
) -> np.ndarray:
    """Columns [1, B, C, B·M, bend_k·max(0, B − knee_k)...]; a bend of −1 makes the slope drop
    past its knee (the coefficients are fitted non-negative, so each change's sign is chosen
    here)."""
    total_on, padded_on = _FORM_MASK[form]
    hinges = [s * np.maximum(0.0, batch - k) for k, s in zip(knees, bends, strict=True)]
    return np.stack(
        [np.ones_like(batch), batch, context * total_on, padded * padded_on, *hinges], axis=-1
    )


class StepCoefficients(NamedTuple):
    """t = fixed + per_seq·B + per_token·C + per_padded_token·B·M
    + Σ_k slope_changes[k]·max(0, B − knees[k]), for callers that evaluate many steps in one
    array expression."""

    fixed: float
    per_seq: float
    per_token: float
    per_padded_token: float
    knees: tuple[float, ...]  # ascending; () when the linear form was best
    slope_changes: tuple[float, ...]  # signed, one per knee


@dataclass(frozen=True, slots=True)
class StepFit:
    coef: np.ndarray  # [a, b, c, e] of the module docstring's form
    knees: tuple[float, ...]  # ascending; (): the linear form was best
    slope_changes: tuple[float, ...]  # d_k, signed; b + the changes up to any knee >= 0
    cv_mape: float  # mean absolute percentage error on held-out folds; nan when too few rows
    form: ContextForm = "total"  # which context terms were kept

    def predict(
        self, batch: np.ndarray, context: np.ndarray, max_context: np.ndarray | None = None
    ) -> np.ndarray:
        """`max_context` None: every sequence holds context / batch tokens."""
        a, b, c, e = self.coef.tolist()
        t = a + b * batch + c * context
        for knee, change in zip(self.knees, self.slope_changes, strict=True):
            t = t + change * np.maximum(0.0, batch - knee)
        if e:
            t = t + e * (context if max_context is None else batch * max_context)
        return np.asarray(t)


def _folds(n: int, k: int) -> list[np.ndarray]:
    order = np.random.default_rng(0).permutation(n)
    return [order[i::k] for i in range(k)]


def _slope_changes(coef: np.ndarray, bends: tuple[float, ...]) -> list[float]:
    """The knees' signed slope changes d_k of a fit's coefficients [a, b, c, e, |d_k|...],
    each cut so that the slope past it stays >= 0 (a step never gets cheaper with more work)."""
    changes, slope = [], coef[1]
    for bend, size in zip(bends, coef[4:], strict=True):
        changes.append(max(bend * size, -slope))
        slope += changes[-1]
    return changes


def _as_used(coef: np.ndarray, bends: tuple[float, ...]) -> tuple[np.ndarray, bool]:
    """The coefficients of the model as `StepFit` uses it (its slope changes cut at flat), for
    the same feature columns, and whether a cut changed them."""
    used = coef.copy()
    used[4:] = np.array(bends) * np.array(_slope_changes(coef, bends))
    return used, not np.allclose(used[4:], coef[4:], rtol=1e-9, atol=0.0)


def _cv_error(x: np.ndarray, y: np.ndarray, bends: tuple[float, ...]) -> float:
    """Mean held-out relative error of the model as used: a fit whose slope turns negative
    past a knee (a step at batch 4 measured faster than one at batch 3) is cut at flat, and
    the rest of its line no longer fits, so it is scored cut."""
    n = len(y)
    if n < 6:
        return float("nan")
    errors = []
    for test in _folds(n, min(5, n)):
        train = np.setdiff1d(np.arange(n), test)
        coef, _ = _as_used(_nonneg_relative_lstsq(x[train], y[train]), bends)
        errors.append(np.abs(x[test] @ coef - y[test]) / y[test])
    return float(np.mean(np.concatenate(errors)))


def _row_arrays(rows: Sequence[DecodeRow]) -> tuple[np.ndarray, ...]:
    batch = np.array([r.batch for r in rows], dtype=float)
    context = np.array([r.context_tokens for r in rows], dtype=float)
    padded = np.array([r.padded_tokens for r in rows], dtype=float)
    return batch, context, padded, np.array([r.seconds for r in rows])


def fit_step(rows: Sequence[DecodeRow], context_form: ContextForm | None = None) -> StepFit:
    """Fit one TP size's decode rows, choosing the knees and the context form by
    cross-validated error (ties go to the simpler form: fewer knees, total context).
    `context_form` imposes the form instead: what the engine knows of its attention backend
    decides where rows of equal lengths cannot."""
    batch, context, padded, y = _row_arrays(rows)
    skewed = bool((padded > context * (1 + 1e-9) + 1).any())
    forms: tuple[ContextForm, ...] = ("total", "padded", "both") if skewed else ("total",)
    if context_form is not None:
        forms = (context_form,)
    # A knee either steepens the slope (compute-bound past it) or flattens it (a CPU's small
    # batches can be slow per sequence, then cheap, then linear again: two knees). Knees sit
    # at profiled batch sizes, inside the grid.
    inner = np.unique(batch)[1:-1].tolist()
    knee_sets = [tuple(ks) for n in range(MAX_KNEES + 1) for ks in itertools.combinations(inner, n)]
    candidates = [
        (form, knees, bends)
        for form in forms
        for knees in knee_sets
        for bends in itertools.product((1.0, -1.0), repeat=len(knees))
    ]
    errors, fits = [], []  # per candidate: held-out error, fit of all rows
    for form, knees, bends in candidates:
        x = _decode_features(batch, context, padded, knees, form, bends)
        fits.append(_nonneg_relative_lstsq(x, y))
        _, cut = _as_used(fits[-1], bends)
        # a fit of all rows that must be cut is not the fit its held-out error scored
        errors.append(np.inf if cut else _cv_error(x, y, bends))
    err, (form, knees, bends) = float("nan"), candidates[0]
    if np.isfinite(errors).any():
        err, (form, knees, bends) = _simplest_good_enough(errors, candidates)
    coef = fits[candidates.index((form, knees, bends))]
    # signed from here on: past each knee the slope is b + the changes so far, never below 0
    changes = _slope_changes(coef, bends)
    kept = [(k, d) for k, d in zip(knees, changes, strict=True) if d != 0.0]
    return StepFit(
        coef=coef[:4],
        knees=tuple(k for k, _ in kept),
        slope_changes=tuple(d for _, d in kept),
        cv_mape=err,
        form=form,
    )


# a fit with one more knee must cut the held-out error by this fraction of the fit it
# replaces: a knee that barely helps still costs the planner an ordered pass per call
KNEE_GAIN = 0.10
# ... and by this much (a held-out relative error): on noiseless rows every form fits to
# rounding, where a relative cut is noise
KNEE_FLOOR = 1e-9


def _simplest_good_enough(
    errors: list[float], candidates: list[tuple[ContextForm, tuple[float, ...], tuple[float, ...]]]
) -> tuple[float, tuple[ContextForm, tuple[float, ...], tuple[float, ...]]]:
    """The candidate to fit: the fewest knees whose best held-out error no candidate with more
    knees beats by `KNEE_GAIN`, then the first (simplest form) as good as that best."""
    best: dict[int, float] = {}
    for error, (_, knees, _) in zip(errors, candidates, strict=True):
        if np.isfinite(error):
            best[len(knees)] = min(error, best.get(len(knees), np.inf))
    levels = sorted(best)
    chosen = levels[0]
    for n in levels[1:]:
        if best[n] < (1 - KNEE_GAIN) * best[chosen] - KNEE_FLOOR:
            chosen = n
    pairs = zip(errors, candidates, strict=True)
    return next((e, c) for e, c in pairs if len(c[1]) == chosen and e <= best[chosen] + 1e-9)


class PrefillCoefficients(NamedTuple):
    """t = fixed + Σ over the batch's sequences of (per_seq + per_token·T + per_token_sq·T²)."""

    fixed: float
    per_seq: float
    per_token: float
    per_token_sq: float


def _fit_prefill(rows: Sequence[PrefillRow]) -> PrefillCoefficients:
    seqs = np.array([r.num_seqs for r in rows], dtype=float)
    tokens = np.array([r.tokens for r in rows], dtype=float)
    y = np.array([r.seconds for r in rows])
    x = np.stack([np.ones_like(seqs), seqs, seqs * tokens, seqs * tokens**2], axis=-1)
    if len(set(seqs.tolist())) == 1:  # `per_seq` is not told apart from `fixed`: 0
        x[:, 1] = 0.0
    a, s, b, c = _nonneg_relative_lstsq(x, y).tolist()
    return PrefillCoefficients(a, s, b, c)


def _fit_collective(rows: Sequence[CollectiveRow]) -> np.ndarray:
    nbytes = np.array([r.nbytes for r in rows], dtype=float)
    y = np.array([r.seconds for r in rows])
    return _nonneg_relative_lstsq(np.stack([np.ones_like(nbytes), nbytes], axis=-1), y)


@dataclass(slots=True)
class LatencyModel:
    model: ModelInfo
    dtype: str
    num_devices: int
    memory_bytes_per_device: int
    step_fits: dict[int, StepFit]
    prefill_coef: dict[int, PrefillCoefficients]
    collective_coef: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    # (src tp, dst tp) -> measured seconds of a switch before its sequences (see _fit_switch)
    switch_s: dict[tuple[int, int], float] = field(default_factory=dict)
    # (src tp, dst tp) -> seconds each sequence in flight adds to a switch beyond its KV bytes
    switch_per_seq_s: dict[tuple[int, int], float] = field(default_factory=dict)
    # (src tp, dst tp) -> seconds each context token in flight adds beyond its KV bytes
    switch_per_token_s: dict[tuple[int, int], float] = field(default_factory=dict)
    # tp -> (seconds a verify step adds to a decode step at all, seconds each query token
    # past a sequence's first adds), fitted on verify rows; a tp without them prices its
    # extra tokens as sequences
    verify_s: dict[int, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def fit(cls, profile: Profile, context_form: ContextForm | None = None) -> LatencyModel:
        """`context_form`: None lets held-out error pick total / padded / both context terms
        (only total when every row holds equal lengths); "padded" for an attention backend
        that pads to the longest sequence (our sdpa), "total" for a ragged one (flash)."""
        step_fits = {
            tp: fit_step([r for r in profile.decode if r.tp == tp], context_form)
            for tp in profile.tp_sizes
        }
        prefill_coef = {
            tp: _fit_prefill([r for r in profile.prefill if r.tp == tp])
            for tp in sorted({r.tp for r in profile.prefill})
        }
        collective_coef: dict[tuple[str, int], np.ndarray] = {}
        for op, group in sorted({(r.op, r.group_size) for r in profile.collectives}):
            same = [r for r in profile.collectives if (r.op, r.group_size) == (op, group)]
            collective_coef[(op, group)] = _fit_collective(same)
        latency = cls(
            model=profile.model,
            dtype=profile.dtype,
            num_devices=profile.hardware.num_devices,
            memory_bytes_per_device=profile.hardware.memory_bytes_per_device,
            step_fits=step_fits,
            prefill_coef=prefill_coef,
            collective_coef=collective_coef,
        )
        for tp in sorted({r.tp for r in profile.verify} & set(step_fits)):
            latency.verify_s[tp] = latency._fit_verify([r for r in profile.verify if r.tp == tp])
        for pair in {(r.src_tp, r.dst_tp) for r in profile.switches}:
            pair_rows = [r for r in profile.switches if (r.src_tp, r.dst_tp) == pair]
            fit = latency._fit_switch(pair_rows)
            latency.switch_s[pair], latency.switch_per_seq_s[pair] = fit[:2]
            latency.switch_per_token_s[pair] = fit[2]
        return latency

    def _fit_switch(self, rows: Sequence[SwitchRow]) -> tuple[float, float, float]:
        """(fixed seconds, seconds per sequence in flight, seconds per context token in flight)
        of one (src, dst) pair's switches, each term non-negative.

        Rows with sequences in flight decide: a relative least-squares plane through what each
        took beyond the separately priced KV transfer, over as many of (sequences, tokens) as
        the rows tell apart; at one load, the empty switches' median plus a slope through it.
        Without such rows, the empty switches' median alone. Why per sequence: states cross in
        pickled collectives and KV is copied in and out of the caches."""
        empty = [r.seconds for r in rows if r.num_seqs == 0]
        loaded = [r for r in rows if r.num_seqs]
        fixed = float(np.median(empty)) if empty else 0.0
        if not loaded:
            return fixed, 0.0, 0.0
        n = np.array([r.num_seqs for r in loaded], dtype=float)
        tokens = np.array([r.context_tokens for r in loaded], dtype=float)
        kv = [self.switch_kv_time(r.src_tp, r.dst_tp, r.context_tokens) for r in loaded]
        beyond = np.maximum(np.array([r.seconds for r in loaded]) - kv, 1e-9)
        x = np.stack([np.ones_like(n), n, tokens], axis=-1)
        if np.linalg.matrix_rank(x / np.where(x.max(axis=0) > 0, x.max(axis=0), 1.0)) == 3:
            a, b, c = _nonneg_relative_lstsq(x, beyond)
            return float(a), float(b), float(c)
        if len(set(n.tolist())) > 1:
            a, b = _nonneg_relative_lstsq(x[:, :2], beyond)
            return float(a), float(b), 0.0
        if not empty:
            return float(np.median(beyond)), 0.0, 0.0
        return fixed, max(0.0, float(np.median((beyond - fixed) / n))), 0.0

    def _fit_verify(self, rows: Sequence[VerifyRow]) -> tuple[float, float]:
        """(f, v) of the module docstring: least squares of each verify row's excess over the
        decode fit at its batch and context against [1, B·(q − 1)], both kept >= 0 (a term
        that fits negative is dropped and the other refitted: verifying more tokens never makes
        a step cheaper)."""
        extra = np.array([r.batch * (r.query_len - 1) for r in rows], dtype=float)
        decode = self.step_time(
            rows[0].tp,
            np.array([r.batch for r in rows], dtype=float),
            np.array([r.context_tokens for r in rows], dtype=float),
        )
        excess = np.array([r.seconds for r in rows]) - decode
        x = np.stack([np.ones_like(extra), extra], axis=-1)
        (f, v), *_ = np.linalg.lstsq(x, excess, rcond=None)
        if f < 0:
            f, v = 0.0, float(extra @ excess / (extra @ extra))
        elif v < 0:
            f, v = float(np.mean(excess)), 0.0
        return max(0.0, float(f)), max(0.0, float(v))

    def verify_time(
        self, tp: int, batch: float, query_tokens: float, context_tokens: float
    ) -> float:
        """Seconds of a decode step of `batch` sequences carrying `query_tokens` query tokens in
        all (`batch`: a plain decode step; more: a speculative verify step) over
        `context_tokens` of context. With verify rows for `tp`: the decode fit plus the fitted
        price of verifying and of each extra token. Without: the extra tokens priced as that
        many more decode sequences holding no more context (their rows through the layers and
        the sampler), an estimate that measured verify rows replace."""
        if query_tokens < batch:
            raise ValueError(f"query_tokens={query_tokens} < batch={batch}: one token at least")
        decode = float(self.step_time(tp, batch, context_tokens))
        if query_tokens == batch:
            return decode
        fit = self.verify_s.get(tp)
        if fit is None:
            return float(self.step_time(tp, query_tokens, context_tokens))
        fixed, per_token = fit
        return decode + fixed + per_token * (query_tokens - batch)

    @property
    def tp_sizes(self) -> list[int]:
        return sorted(self.step_fits)

    def _step_fit(self, tp: int) -> StepFit:
        if tp not in self.step_fits:
            raise KeyError(f"no decode rows for tp={tp}; the profile has tp in {self.tp_sizes}")
        return self.step_fits[tp]

    def step_time(
        self,
        tp: int,
        batch: np.ndarray | float,
        context_tokens: np.ndarray | float,
        max_context: np.ndarray | float | None = None,
    ) -> np.ndarray:
        """Seconds of one decode step of `batch` sequences holding `context_tokens` in total,
        the longest `max_context` (None: all equal); vectorised over arrays of them."""
        b = np.asarray(batch, dtype=float)
        c = np.asarray(context_tokens, dtype=float)
        m = None if max_context is None else np.asarray(max_context, dtype=float)
        return self._step_fit(tp).predict(b, c, m)

    def step_coefficients(self, tp: int) -> StepCoefficients:
        fit = self._step_fit(tp)
        a, b, c, e = fit.coef.tolist()
        return StepCoefficients(a, b, c, e, fit.knees, fit.slope_changes)

    def prefill_coefficients(self, tp: int) -> PrefillCoefficients:
        """Of a prefill step: see `PrefillCoefficients`."""
        if tp not in self.prefill_coef:
            raise KeyError(
                f"no prefill rows for tp={tp}; the profile has {sorted(self.prefill_coef)}"
            )
        return self.prefill_coef[tp]

    def send_coefficients(self) -> tuple[float, float]:
        """(α, seconds per byte) of a point-to-point transfer."""
        alpha, per_byte = self._collective("send", 2).tolist()
        return alpha, per_byte

    def prefill_fixed(self, tp: int) -> float:
        """Seconds a prefill batch costs however few sequences it holds."""
        return self.prefill_coefficients(tp).fixed

    def prefill_marginal(self, tp: int, tokens: np.ndarray) -> np.ndarray:
        """Seconds one more sequence of `tokens` adds to a prefill batch."""
        _, s, b, c = self.prefill_coefficients(tp)
        t = np.asarray(tokens, dtype=float)
        return np.asarray(s + b * t + c * t * t)

    def prefill_time(self, tp: int, lengths: Sequence[int] | np.ndarray) -> float:
        """Seconds to prefill a batch of sequences of these lengths (0 for an empty batch)."""
        lengths = np.asarray(lengths, dtype=float)
        if lengths.size == 0:
            return 0.0
        return self.prefill_fixed(tp) + float(self.prefill_marginal(tp, lengths).sum())

    def _collective(self, op: str, group_size: int) -> np.ndarray:
        key = (op, group_size)
        if key not in self.collective_coef:
            raise KeyError(
                f"no collective rows for op={op!r} group_size={group_size}; "
                f"the profile has {sorted(self.collective_coef)}"
            )
        return self.collective_coef[key]

    def collective_time(self, op: str, nbytes: float, group_size: int) -> float:
        if group_size == 1 or nbytes <= 0:
            return 0.0
        alpha, inv_bw = self._collective(op, group_size)
        return float(alpha + inv_bw * nbytes)

    def send_marginal(self, nbytes: np.ndarray) -> np.ndarray:
        """Seconds each extra byte of a point-to-point transfer costs (bandwidth term only)."""
        return np.asarray(self._collective("send", 2)[1] * np.asarray(nbytes, dtype=float))

    def send_fixed(self) -> float:
        return float(self._collective("send", 2)[0])

    def send_time(self, nbytes: float) -> float:
        return self.collective_time("send", nbytes, 2)

    def kv_bytes(self, tokens: np.ndarray) -> np.ndarray:
        """KV bytes of sequences holding `tokens` tokens, all heads."""
        return np.asarray(tokens, dtype=float) * self.model.kv_bytes_per_token(self.dtype)

    def weight_reshard_time(self, src_tp: int, dst_tp: int) -> float:
        """Growing TP narrows what each rank already holds, in place: no traffic. Shrinking
        gathers the missing parts from the src_tp/dst_tp peers that held them."""
        if dst_tp >= src_tp:
            return 0.0
        per_rank = self.model.weight_bytes(self.dtype) / dst_tp
        return self.reshard_time(per_rank, src_tp // dst_tp)

    def reshard_time(self, nbytes_per_rank: float, group_size: int) -> float:
        """Seconds to gather `nbytes_per_rank` of weights on every rank of a group (the byte
        counts come from tpreshard's move plans)."""
        return self.collective_time("all_gather", nbytes_per_rank, group_size)

    def kv_migrate_time(self, nbytes: float) -> float:
        """Seconds to move `nbytes` of KV over one link."""
        return self.send_time(nbytes)

    def kv_recompute_time(self, tp: int, tokens: Sequence[int] | np.ndarray) -> float:
        """Seconds to rebuild the KV of sequences of these lengths by one prefill."""
        return self.prefill_time(tp, tokens)

    def switch_migrate_per_token(self, src_tp: int, dst_tp: int) -> float:
        """Seconds per context token of migrating KV from src_tp to dst_tp: the heads that
        change rank (1 - lo/hi of them) land on the larger group's ranks at once, each over
        its own link."""
        lo, hi = min(src_tp, dst_tp), max(src_tp, dst_tp)
        if lo == hi or ("send", 2) not in self.collective_coef:
            return 0.0
        per_token = float(self.kv_bytes(np.ones(1))[0])
        return per_token * self.send_coefficients()[1] * (1 - lo / hi) / hi

    def switch_kv_time(self, src_tp: int, dst_tp: int, tokens: float) -> float:
        """Seconds of migrating the KV of `tokens` context tokens from src_tp to dst_tp."""
        if tokens <= 0 or src_tp == dst_tp or ("send", 2) not in self.collective_coef:
            return 0.0
        return self.send_fixed() + tokens * self.switch_migrate_per_token(src_tp, dst_tp)

    def switch_per_seq_time(self, src_tp: int, dst_tp: int) -> float:
        """Seconds each sequence in flight adds to a switch beyond its KV bytes (0 when the
        profile measured no switch with sequences in flight)."""
        return self.switch_per_seq_s.get((src_tp, dst_tp), 0.0)

    def switch_per_token_time(self, src_tp: int, dst_tp: int) -> float:
        """Seconds each context token in flight adds to a switch beyond its KV bytes (0 when
        the profile's switches in flight did not tell context lengths apart)."""
        return self.switch_per_token_s.get((src_tp, dst_tp), 0.0)

    def switch_fixed_time(self, world_size: int) -> float:
        """Every switch is collective: at least one barrier across the world."""
        if ("all_reduce", world_size) not in self.collective_coef:
            return 0.0
        return self.collective_time("all_reduce", 4, world_size)

    def switch_time(self, src_tp: int, dst_tp: int, world_size: int) -> float:
        """The fixed price of switching from src_tp to dst_tp, before any KV moves: measured
        when the profile has it (a narrowing "in place" still copies what it keeps and
        re-makes the KV cache, which a traffic-only estimate prices at 0), else the barrier
        plus the weight gather."""
        measured = self.switch_s.get((src_tp, dst_tp))
        if measured is not None:
            return measured
        return self.switch_fixed_time(world_size) + self.weight_reshard_time(src_tp, dst_tp)

    def kv_capacity_tokens(self, tp: int, memory_utilization: float) -> int:
        """Tokens of KV one replica of `tp` ranks can hold after its weight shards."""
        budget = self.memory_bytes_per_device * memory_utilization
        free = budget - self.model.weight_bytes(self.dtype) / tp
        per_token = (
            self.model.kv_bytes_per_token(self.dtype)
            * self.model.kv_heads_per_rank(tp)
            / self.model.num_kv_heads
        )
        return max(0, int(free // per_token))

    def describe(self) -> dict[int, dict[str, Any]]:
        """Chosen form, knees and cross-validated error per TP size, for reports (JSON-ready):
        the coefficients a, b, c, e of the module docstring's form and d, one per knee."""
        return {
            tp: {
                "knees": list(fit.knees),
                "d": list(fit.slope_changes),
                "cv_mape": fit.cv_mape,
                "form": fit.form,
                **dict(zip("abce", fit.coef.tolist(), strict=True)),
            }
            for tp, fit in self.step_fits.items()
        }


def held_out_error(profile: Profile, fraction: float = 0.25, seed: int = 0) -> dict[int, float]:
    """Median absolute percentage error of decode-step predictions on rows held out of the fit
    (form selection included), per TP size."""
    rng = np.random.default_rng(seed)
    result = {}
    for tp in profile.tp_sizes:
        rows = [r for r in profile.decode if r.tp == tp]
        test_mask = rng.random(len(rows)) < fraction
        train = [r for r, t in zip(rows, test_mask, strict=True) if not t]
        test = [r for r, t in zip(rows, test_mask, strict=True) if t]
        if len(train) < 3 or not test:
            raise ValueError(f"tp={tp} has {len(rows)} decode rows; too few to hold {fraction} out")
        batch, context, padded, y = _row_arrays(test)
        pred = fit_step(train).predict(batch, context, padded / batch)
        result[tp] = _mape(pred, y)
    return result
