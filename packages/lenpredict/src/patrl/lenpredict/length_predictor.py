"""Online response-length prediction for GRPO rollouts (`LengthPredictor`).

A sample of prompt p has length L = μ_p · R: R a prompt-independent *shape* (lengths over their
group's mean, from every completed group), μ_p the prompt's scale, estimated from an EWMA of its
past group means and from the current group's finished siblings (the first k of n to finish are
the k shortest, so each is compared with the shape's expected order statistic), shrunk towards
the global mean. A running sequence at length l gets remaining-length quantiles from the
survival model P(μ_p·R > l + k | μ_p·R > l), blended with the prompt's own past samples longer
than l (a pooled shape cannot see a prompt whose samples split into short and long answers).
Every prediction is scored when its sequence finishes (online MAE and quantile coverage).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class PredictorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    quantiles: tuple[float, ...] = (0.1, 0.5, 0.9)
    ewma_alpha: float = Field(default=0.5, gt=0, le=1)
    # pseudo-counts, in units of one finished sibling: how much the prompt's history and the
    # global mean weigh against the siblings seen in this group
    history_weight: float = Field(default=4.0, ge=0)
    prior_weight: float = Field(default=1.0, gt=0)
    window: int = Field(default=8192, gt=0)  # finished lengths / shape ratios kept
    max_length: int | None = Field(default=None, gt=0)  # max_response_length, caps every prediction
    default_length: float = Field(default=1024.0, gt=0)  # before anything has finished
    # a prompt's own past sample lengths kept (0: none), and the pseudo-count of the pooled
    # shape against those of them longer than a running sample
    prompt_samples: int = Field(default=64, ge=0)
    prompt_weight: float = Field(default=2.0, gt=0)


@dataclass(slots=True)
class _Group:
    prompt_id: str
    size: int
    finished: list[int] = field(default_factory=list)
    scale: tuple[int, float] | None = None  # (predictor version it was computed at, μ)


def _blom(i: np.ndarray, n: int) -> np.ndarray:
    """Plotting positions of the i-th (1-based) smallest of n: expected order statistics."""
    return (i - 0.375) / (n + 0.25)


def _lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """a + (b - a)·t as numpy's quantile computes it (from the nearer end); the offset
    virtual index can differ from numpy's by rounding (~1e-13)."""
    diff = b - a
    return np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)


def _tail_quantiles(
    values: np.ndarray, start: np.ndarray, levels: np.ndarray, end: np.ndarray | None = None
) -> np.ndarray:
    """(n, Q): np.quantile(values[start[i]:end[i]], levels) ("linear") for each row, from
    `values` sorted within each row's [.., end) (`end` defaults to the whole array), in one
    pass (virtual index q·(m - 1) past start); a start at or past its end reads the last
    value before the end."""
    stop = np.full(start.shape, values.size) if end is None else end
    first = np.minimum(start, stop - 1)
    virtual = first[:, None] + levels[None, :] * (stop - 1 - first)[:, None]
    lo = np.floor(virtual).astype(int)
    hi = np.minimum(lo + 1, (stop - 1)[:, None])
    return _lerp(values[lo], values[hi], virtual - lo)


def _merged(cache: np.ndarray | None, out: list[float], new: list[float]) -> np.ndarray:
    """`cache` (sorted) less the values `out` (each one of its own) plus `new`, sorted."""
    assert cache is not None
    old = np.sort(np.asarray(out, dtype=float))
    # equal values leave from consecutive places: the k-th of a run from start + k
    at = np.searchsorted(cache, old, side="left")
    at += np.arange(old.size) - np.searchsorted(old, old, side="left")
    kept = np.delete(cache, at)
    added = np.sort(np.asarray(new, dtype=float))
    return np.insert(kept, np.searchsorted(kept, added), added)


class LengthPredictor:
    def __init__(self, config: PredictorConfig | None = None) -> None:
        self.config = config or PredictorConfig()
        self._levels = np.asarray(self.config.quantiles, dtype=float)
        self._median_at = int(np.argmin(np.abs(self._levels - 0.5)))  # the quantile scored
        self._lengths: deque[int] = deque(maxlen=self.config.window)
        self._ratios: deque[float] = deque(maxlen=self.config.window)
        self._prompts: dict[str, tuple[float, int]] = {}  # prompt -> (ewma of group means, groups)
        self._groups: dict[str, _Group] = {}
        self._pending: dict[str, list[tuple[int, list[float]]]] = {}
        self._abs_err = 0.0
        self._hits = np.zeros(len(self.config.quantiles))
        self._scored = 0
        self._shape_cache: np.ndarray | None = None
        # since the sorted copy was last read: ratios that entered the window, and those of
        # the copy that left it (`_add_ratios`)
        self._shape_in: list[float] = []
        self._shape_out: list[float] = []
        self._version = 0  # bumped by every observation: invalidates cached group scales
        self._lengths_sum = 0  # of `_lengths`, kept as they come and go (the global mean)
        self._prompt_lengths: dict[str, deque[int]] = {}  # of completed groups, newest last
        self._prompt_sorted: dict[str, np.ndarray] = {}  # cache of the above, sorted

    # --- learning -----------------------------------------------------------------------

    def start_group(self, group_id: str, prompt_id: str, size: int) -> None:
        """Declare a GRPO group of `size` samples of `prompt_id` that is about to be generated."""
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} already started")
        self._groups[group_id] = _Group(prompt_id=prompt_id, size=size)

    def extend_group(self, group_id: str, extra: int) -> None:
        """`extra` more samples join an open group (another request of the same prompt)."""
        if extra < 1:
            raise ValueError(f"a group grows by at least one sample, got {extra}")
        group = self._group(group_id)
        group.size += extra
        group.scale = None

    def observe_finished(self, seq_id: str, group_id: str, length: int) -> None:
        """A sample finished with `length` response tokens; the group closes at its last one."""
        group = self._group(group_id)
        group.finished.append(length)
        if len(self._lengths) == self._lengths.maxlen:
            self._lengths_sum -= self._lengths[0]  # about to leave the window
        self._lengths.append(length)
        self._lengths_sum += length
        self._version += 1
        if not self._ratios:
            self._drop_shape()  # the global spread stands in for the shape: it moved
        self._score(seq_id, length)
        if len(group.finished) == group.size:
            self.end_group(group_id)

    def end_group(self, group_id: str) -> None:
        """Fold a group into the prompt history and the shape (also for aborted groups)."""
        group = self._groups.pop(group_id)
        if not group.finished:
            return
        self._version += 1  # the prompt's history moves: its other groups' scales with it
        mean = sum(group.finished) / len(group.finished)
        old = self._prompts.get(group.prompt_id)
        alpha = self.config.ewma_alpha
        ewma = mean if old is None else alpha * mean + (1 - alpha) * old[0]
        self._prompts[group.prompt_id] = (ewma, 1 if old is None else old[1] + 1)
        complete = len(group.finished) == group.size
        if complete and self.config.prompt_samples:  # a cut-short group's are the short ones
            kept = self._prompt_lengths.setdefault(
                group.prompt_id, deque(maxlen=self.config.prompt_samples)
            )
            kept.extend(group.finished)
            self._prompt_sorted.pop(group.prompt_id, None)
        # a group of one, or one cut short, says nothing about the spread inside a prompt
        if group.size > 1 and complete:
            self._add_ratios([length / mean for length in group.finished])

    def _group(self, group_id: str) -> _Group:
        if group_id not in self._groups:
            raise KeyError(f"unknown group {group_id!r}; call start_group first")
        return self._groups[group_id]

    # --- prediction ---------------------------------------------------------------------

    def _add_ratios(self, ratios: list[float]) -> None:
        """Extend the shape samples, noting what enters and leaves the window for their sorted
        copy, which the next read brings up to date in one merge (`_shape`) in place of a
        fresh sort of the whole window. The window's oldest values are the sorted copy's, as
        long as fewer have left than it holds."""
        maxlen = self._ratios.maxlen
        assert maxlen is not None
        leaving = max(0, len(self._ratios) + len(ratios) - maxlen)
        cache = self._shape_cache
        if cache is None or not self._ratios or len(self._shape_out) + leaving > cache.size:
            self._ratios.extend(ratios)
            self._drop_shape()  # rebuilt at the next read
            return
        self._shape_out.extend(self._ratios[i] for i in range(leaving))
        self._shape_in.extend(ratios)
        self._ratios.extend(ratios)

    def _drop_shape(self) -> None:
        self._shape_cache = None
        self._shape_in, self._shape_out = [], []

    def global_mean(self) -> float:
        """Mean of the finished lengths in the window (a running sum: every group's scale asks
        for it, at every check)."""
        if not self._lengths:
            return self.config.default_length
        return self._lengths_sum / len(self._lengths)

    def survival(self, length: int, k: int) -> float:
        """Global P(L > length + k | L > length) over the finished lengths seen."""
        lengths = np.asarray(self._lengths)
        alive = (lengths > length).sum()
        return float((lengths > length + k).sum() / alive) if alive else 0.0

    def expected_length(self, prompt_id: str) -> float:
        """Expected response length of a new sample of `prompt_id`."""
        prior = self.global_mean()
        if prompt_id not in self._prompts:
            return prior
        w_h, w_0 = self.config.history_weight, self.config.prior_weight
        return (w_h * self._prompts[prompt_id][0] + w_0 * prior) / (w_h + w_0)

    def _shape(self) -> np.ndarray:
        """Sorted shape samples (length / group mean); the global spread until groups close."""
        if self._shape_in or self._shape_out:
            self._shape_cache = _merged(self._shape_cache, self._shape_out, self._shape_in)
            self._shape_in, self._shape_out = [], []
        if self._shape_cache is None:
            if self._ratios:
                self._shape_cache = np.sort(np.asarray(self._ratios))
            elif self._lengths:
                lengths = np.asarray(self._lengths, dtype=float)
                self._shape_cache = np.sort(lengths / lengths.mean())
            else:
                self._shape_cache = np.empty(0)
        return self._shape_cache

    def group_scale(self, group_id: str) -> float:
        """Estimated mean length μ of the group's samples."""
        group = self._group(group_id)
        if group.scale is None or group.scale[0] != self._version:
            group.scale = (self._version, self._estimate_scale(group))
        return group.scale[1]

    def _estimate_scale(self, group: _Group) -> float:
        has_history = group.prompt_id in self._prompts
        w0 = self.config.history_weight if has_history else self.config.prior_weight
        mu0 = self.expected_length(group.prompt_id)
        shape = self._shape()
        k = len(group.finished)
        if k == 0 or shape.size == 0:
            return mu0
        ranks = np.arange(1, k + 1)
        expected_ratio = np.quantile(shape, _blom(ranks, max(group.size, k))).sum()
        mu_sib = sum(sorted(group.finished)) / max(expected_ratio, 1e-9)
        return (w0 * mu0 + k * mu_sib) / (w0 + k)

    def predict_remaining(self, seq_id: str, group_id: str, current_length: int) -> np.ndarray:
        """Quantiles (at `config.quantiles`) of the remaining tokens of a running sample."""
        levels = self._levels
        pooled = self._conditional_quantiles(self.group_scale(group_id), current_length, levels)
        current = np.array([float(current_length)])
        prompt = [self._group(group_id).prompt_id]
        quantiles = self._finish(pooled[None, :], prompt, current)[0]
        self._pending.setdefault(seq_id, []).append((current_length, quantiles.tolist()))
        return quantiles

    def predict_remaining_many(
        self, seq_ids: list[str], group_ids: list[str], current_lengths: np.ndarray
    ) -> np.ndarray:
        """`predict_remaining` for many running samples at once, (n, Q): one vectorised pass
        over the shape samples instead of a quantile call per sample (the planner's check
        asks for every running sample)."""
        current = np.asarray(current_lengths, dtype=float)
        n, levels = len(current), self._levels
        if len(seq_ids) != n or len(group_ids) != n:
            raise ValueError(
                f"{len(seq_ids)} seq ids, {len(group_ids)} group ids, {n} current lengths"
            )
        scales = {g: self.group_scale(g) for g in dict.fromkeys(group_ids)}
        mu = np.array([scales[g] for g in group_ids], dtype=float)
        shape = self._shape()
        if shape.size == 0:
            remaining = -mu[:, None] * np.log1p(-levels)[None, :]
        else:
            start = np.searchsorted(shape, current / mu, side="right")
            inside = start < shape.size
            # np.quantile of shape[start:] * mu
            remaining = _tail_quantiles(shape, start, levels) * mu[:, None] - current[:, None]
            if self.config.max_length is not None:
                beyond = levels[None, :] * (self.config.max_length - current)[:, None]
            else:
                beyond = 2 * levels[None, :] * current[:, None]
            remaining = np.where(inside[:, None], remaining, beyond)
        prompts = [self._groups[g].prompt_id for g in group_ids]
        remaining = self._finish(remaining, prompts, current)
        for seq_id, c, row in zip(seq_ids, current.tolist(), remaining.tolist(), strict=True):
            self._pending.setdefault(seq_id, []).append((int(c), row))
        return remaining

    def _finish(self, pooled: np.ndarray, prompts: list[str], current: np.ndarray) -> np.ndarray:
        """The pooled-shape quantiles (n, Q) with each prompt's own averaged in, capped."""
        own, weight = self._prompt_tail(prompts, current)
        remaining = pooled + weight[:, None] * (own - pooled)
        if self.config.max_length is not None:
            remaining = np.minimum(remaining, (self.config.max_length - current)[:, None])
        return np.maximum(remaining, 1.0)

    def _prompt_tail(self, prompts: list[str], current: np.ndarray) -> tuple[np.ndarray, ...]:
        """Quantiles (n, Q) of the remaining length read off each prompt's own past samples
        longer than its `current` (np.quantile "linear" of them, less current), and each row's
        weight m / (m + prompt_weight), m those samples (0 where there are none). One pass
        over every prompt's samples at once: they are laid end to end, each prompt's shifted
        past the one before, so one sorted search finds every row's start in its prompt's."""
        levels = self._levels
        own, weight = np.zeros((len(current), len(levels))), np.zeros(len(current))
        rows_of: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            if prompt in self._prompt_lengths:
                rows_of.setdefault(prompt, []).append(i)
        if not rows_of:
            return own, weight
        pasts = [self._sorted_past(prompt) for prompt in rows_of]
        sizes = np.array([past.size for past in pasts])
        counts = [len(rows) for rows in rows_of.values()]
        rows = np.fromiter((i for r in rows_of.values() for i in r), int, sum(counts))
        segment = np.repeat(np.arange(len(pasts)), counts)
        end = np.cumsum(sizes)[segment]
        t = current[rows]
        values = np.concatenate(pasts)
        # lengths are >= 0: shifting prompt j's by j·span keeps them all sorted end to end
        span = max(float(values.max()), float(t.max())) + 1.0
        shifted = values + np.repeat(np.arange(len(pasts)) * span, sizes)
        start = np.searchsorted(shifted, t + segment * span, side="right")
        longer = end - start
        own[rows] = _tail_quantiles(values, start, levels, end) - t[:, None]
        weight[rows] = np.where(longer > 0, longer / (longer + self.config.prompt_weight), 0.0)
        return own, weight

    def _sorted_past(self, prompt: str) -> np.ndarray:
        past = self._prompt_sorted.get(prompt)
        if past is None:
            past = self._prompt_sorted[prompt] = np.sort(
                np.asarray(self._prompt_lengths[prompt], dtype=float)
            )
        return past

    def _conditional_quantiles(self, mu: float, current: int, levels: np.ndarray) -> np.ndarray:
        shape = self._shape()
        if shape.size == 0:
            return -mu * np.log1p(-levels)  # nothing finished yet: memoryless, mean μ
        start = int(np.searchsorted(shape, current / mu, side="right"))
        if start < shape.size:
            return np.asarray(np.quantile(shape[start:] * mu, levels) - current)
        if self.config.max_length is not None:
            # longer than anything seen at this scale: only the cap bounds it
            return levels * (self.config.max_length - current)
        return 2 * levels * current  # Lindy: the median remaining equals the age

    # --- self-assessment ----------------------------------------------------------------

    def _score(self, seq_id: str, length: int) -> None:
        # plain Python: one or two predictions per sample, scored at every finished sample
        hits, median_at = self._hits, self._median_at
        for current, quantiles in self._pending.pop(seq_id, ()):
            actual = length - current
            self._abs_err += abs(actual - quantiles[median_at])
            for j, q in enumerate(quantiles):
                if actual <= q:
                    hits[j] += 1
            self._scored += 1

    def error_report(self) -> dict[str, Any]:
        """Online error of every scored prediction: MAE of the median, and the fraction of
        outcomes at or below each predicted quantile (a calibrated q-quantile covers q)."""
        n = max(self._scored, 1)
        return {
            "scored": self._scored,
            "mae": self._abs_err / n,
            "coverage": {
                str(q): float(hit / n)
                for q, hit in zip(self.config.quantiles, self._hits, strict=True)
            },
        }

    # --- checkpointing ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.model_dump(),
            "lengths": list(self._lengths),
            "ratios": list(self._ratios),
            "prompts": {p: list(v) for p, v in self._prompts.items()},
            "prompt_lengths": {p: list(v) for p, v in self._prompt_lengths.items()},
            "groups": {
                g: {"prompt_id": s.prompt_id, "size": s.size, "finished": list(s.finished)}
                for g, s in self._groups.items()
            },
            "pending": {s: [[c, list(q)] for c, q in v] for s, v in self._pending.items()},
            "abs_err": self._abs_err,
            "hits": self._hits.tolist(),
            "scored": self._scored,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        config = PredictorConfig.model_validate(state["config"])
        if config != self.config:
            raise ValueError(f"state has config {config} but this predictor has {self.config}")
        self._lengths = deque(state["lengths"], maxlen=config.window)
        self._lengths_sum = sum(self._lengths)
        self._ratios = deque(state["ratios"], maxlen=config.window)
        self._prompts = {p: (float(v[0]), int(v[1])) for p, v in state["prompts"].items()}
        # absent from checkpoints written before it existed: the prompts' samples start anew
        self._prompt_lengths = {
            p: deque(v, maxlen=config.prompt_samples)
            for p, v in state.get("prompt_lengths", {}).items()
        }
        self._prompt_sorted = {}
        self._groups = {g: _Group(**s) for g, s in state["groups"].items()}
        self._version += 1
        self._pending = {s: [(int(c), list(q)) for c, q in v] for s, v in state["pending"].items()}
        self._abs_err = float(state["abs_err"])
        self._hits = np.asarray(state["hits"], dtype=float)
        self._scored = int(state["scored"])
        self._drop_shape()
