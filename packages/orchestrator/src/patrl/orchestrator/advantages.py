"""Advantages (GRPO, Dr.GRPO, RLOO, REINFORCE++ with and without baseline, ReMax, Pass@k GRPO,
OPO, GPG) and DAPO dynamic sampling.

Pure numpy. Samples are flat, in any order; `group_ids[i]` names the prompt that sample i was
drawn for (verl's `index`), so groups may have different sizes (a partial rollout can hand back
an incomplete group). A group of one sample has nothing to be relative to: its advantage is 0
under the group estimators here. (verl instead uses mean 0 and std 1 there, which makes the raw
reward the advantage; a lone sample then pushes the policy with an unbaselined signal.)
REINFORCE++ works on token-level rewards and whitens over every response token of the batch.
ReMax baselines each response by the reward of its prompt's greedy response, which the caller
generates and scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar, get_args

import numpy as np
import numpy.typing as npt

AdvEstimator = Literal[
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "grpo_passk",
    "opo",
    "gpg",
    "grpo_vectorized",
    "rloo_vectorized",
]
ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
# verl's vectorised implementations compute the same advantages as these.
ALIASES = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}
# Estimators whose baseline is the other samples of the group: no signal with rollout.n = 1.
GROUP_ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "dr_grpo",
    "rloo",
    "grpo_passk",
    "opo",
    "gpg",
    "grpo_vectorized",
    "rloo_vectorized",
)

FloatArray = npt.NDArray[np.float64]
G = TypeVar("G")


def grpo_advantages(
    rewards: npt.ArrayLike,
    group_ids: npt.ArrayLike,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> FloatArray:
    """GRPO: (r - group mean) / (group std + eps), the std unbiased (ddof=1) as verl's
    `torch.std`; `norm_by_std=False` is verl's `norm_adv_by_std_in_grpo=False`."""
    r, inverse, counts = _grouped(rewards, group_ids)
    centred = r - _group_sums(r, inverse, counts.size)[inverse] / counts[inverse]
    if norm_by_std:
        sq = _group_sums(centred**2, inverse, counts.size)
        std = np.sqrt(sq / np.maximum(counts - 1, 1))
        centred = centred / (std[inverse] + eps)
    return np.where(counts[inverse] > 1, centred, 0.0)


def dr_grpo_advantages(rewards: npt.ArrayLike, group_ids: npt.ArrayLike) -> FloatArray:
    """Dr.GRPO: r - group mean. Dividing by the std up-weights groups that are nearly solved or
    nearly failed (a difficulty bias), so Dr.GRPO leaves it out."""
    return grpo_advantages(rewards, group_ids, norm_by_std=False)


def rloo_advantages(rewards: npt.ArrayLike, group_ids: npt.ArrayLike) -> FloatArray:
    """RLOO: r_i - mean of the other samples of its group = n/(n-1) * (r_i - group mean)."""
    r, inverse, counts = _grouped(rewards, group_ids)
    n = counts[inverse]
    others = (_group_sums(r, inverse, counts.size)[inverse] - r) / np.maximum(n - 1, 1)
    return np.where(n > 1, r - others, 0.0)


def grpo_passk_advantages(
    rewards: npt.ArrayLike, group_ids: npt.ArrayLike, *, norm_by_std: bool = True, eps: float = 1e-6
) -> FloatArray:
    """Pass@k GRPO (verl's `grpo_passk`, arXiv 2503.19595): only the best sample of a group
    gets an advantage, r_max - r_second_max (divided by the group's unbiased std + eps with
    `norm_by_std`); the others get 0. Ties give 0 to every sample."""
    r, inverse, counts = _grouped(rewards, group_ids)
    out = np.zeros_like(r)
    for g in range(counts.size):
        members = np.flatnonzero(inverse == g)
        if members.size < 2:
            continue
        values = r[members]
        best = int(members[np.argmax(values)])
        top2 = np.sort(values)[-2:]
        adv = top2[1] - top2[0]
        if norm_by_std:
            adv = adv / (values.std(ddof=1) + eps)
        out[best] = adv
    return out


def opo_advantages(
    rewards: npt.ArrayLike, group_ids: npt.ArrayLike, lengths: Sequence[int]
) -> FloatArray:
    """OPO (verl's `opo`, arXiv 2505.23585): r minus its group's length-weighted mean reward
    sum(len_j r_j) / sum(len_j)."""
    r, inverse, counts = _grouped(rewards, group_ids)
    n = np.asarray(lengths, dtype=np.float64)
    if n.shape != r.shape:
        raise ValueError(f"{n.size} lengths for {r.size} rewards: need one per sample")
    weighted = _group_sums(n * r, inverse, counts.size)
    total = _group_sums(n, inverse, counts.size)
    baseline = weighted / np.maximum(total, 1e-300)
    return np.where(counts[inverse] > 1, r - baseline[inverse], 0.0)


def gpg_advantages(rewards: npt.ArrayLike, group_ids: npt.ArrayLike) -> FloatArray:
    """GPG (verl's `gpg`, f_norm 1): alpha (r - group mean), alpha = batch size / the number
    of samples with a non-zero reward (at least 1)."""
    r, inverse, counts = _grouped(rewards, group_ids)
    alpha = r.size / max(int(np.count_nonzero(r)), 1)
    centred = r - _group_sums(r, inverse, counts.size)[inverse] / counts[inverse]
    return np.where(counts[inverse] > 1, alpha * centred, 0.0)


def compute_advantages(
    estimator: str,
    rewards: npt.ArrayLike,
    group_ids: npt.ArrayLike,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    lengths: Sequence[int] | None = None,
) -> FloatArray:
    """One advantage per sample by name (verl's `algorithm.adv_estimator`), for the outcome
    estimators; `token_advantages` takes every estimator. `lengths` (response tokens): opo's."""
    estimator = ALIASES.get(estimator, estimator)
    if estimator == "grpo_passk":
        return grpo_passk_advantages(rewards, group_ids, norm_by_std=norm_adv_by_std_in_grpo)
    if estimator == "gpg":
        return gpg_advantages(rewards, group_ids)
    if estimator == "opo":
        if lengths is None:
            raise ValueError("adv_estimator 'opo' needs the response lengths")
        return opo_advantages(rewards, group_ids, lengths)
    if estimator == "grpo":
        return grpo_advantages(rewards, group_ids, norm_by_std=norm_adv_by_std_in_grpo)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards, group_ids)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_ids)
    if estimator in ADV_ESTIMATORS:
        raise ValueError(f"adv_estimator {estimator!r} is token-level: use token_advantages")
    raise ValueError(f"unknown adv_estimator {estimator!r}; accepted: {', '.join(ADV_ESTIMATORS)}")


def per_token(advantages: npt.ArrayLike, response_lengths: Sequence[int]) -> list[FloatArray]:
    """Broadcast each sequence's scalar advantage over its response tokens."""
    adv = np.asarray(advantages, dtype=np.float64)
    if adv.ndim != 1 or adv.size != len(response_lengths):
        raise ValueError(
            f"advantages of shape {adv.shape} for {len(response_lengths)} responses: "
            "need one scalar per response"
        )
    for i, length in enumerate(response_lengths):
        if length < 0:
            raise ValueError(f"response_lengths[{i}] = {length}; lengths must be >= 0")
    return [
        np.full(int(length), a) for a, length in zip(adv.tolist(), response_lengths, strict=True)
    ]


def token_level_scores(scores: npt.ArrayLike, response_lengths: Sequence[int]) -> list[FloatArray]:
    """verl's token_level_scores: each response's scalar score on its last token, 0 on the
    others (an empty response gets an empty array)."""
    out = [np.zeros(int(n)) for n in response_lengths]
    for row, score in zip(out, np.asarray(scores, dtype=np.float64).tolist(), strict=True):
        if row.size:
            row[-1] = score
    return out


def reinforce_plus_plus_advantages(
    token_rewards: Sequence[npt.ArrayLike],
    gamma: float = 1.0,
    masks: Sequence[npt.ArrayLike] | None = None,
) -> list[FloatArray]:
    """REINFORCE++: each token's discounted return-to-go, whitened over every response token
    of the batch (verl's masked_whiten: unbiased variance, 1e-8 under the root). `masks`
    (bool, one per response token; multi-turn: False on appended tool tokens): the returns
    run over the masked tokens only, skipping the others as GAE does (a model token before a
    tool turn discounts once to the next model token), the whitening reads the masked tokens
    only, and the others get 0: as the estimator computed on the model's tokens alone."""
    keep = _masks(token_rewards, masks)
    returns = []
    for rewards, m in zip(token_rewards, keep, strict=True):
        r = np.asarray(rewards, dtype=np.float64)
        ret = np.zeros_like(r)
        running = 0.0
        for t in range(r.size - 1, -1, -1):
            if m[t]:
                running = r[t] + gamma * running
                ret[t] = running
        returns.append(ret)
    return _whiten(returns, keep)


def reinforce_plus_plus_baseline_advantages(
    rewards: npt.ArrayLike,
    group_ids: npt.ArrayLike,
    response_lengths: Sequence[int],
    masks: Sequence[npt.ArrayLike] | None = None,
) -> list[FloatArray]:
    """REINFORCE++-baseline: r - group mean (a group of one keeps r, as verl: the batch-wide
    whitening then baselines it), broadcast over the response and whitened over every
    response token of the batch; with `masks`, over the masked tokens only (the others 0)."""
    r, inverse, counts = _grouped(rewards, group_ids)
    mean = _group_sums(r, inverse, counts.size)[inverse] / counts[inverse]
    centred = np.where(counts[inverse] > 1, r - mean, r)
    tokens = per_token(centred, response_lengths)
    return _whiten(tokens, _masks(tokens, masks))


def remax_advantages(
    token_rewards: Sequence[npt.ArrayLike], baselines: npt.ArrayLike
) -> list[FloatArray]:
    """ReMax (verl's `compute_remax_outcome_advantage`): each token's undiscounted return-to-go
    minus its response's baseline, the reward of the prompt's greedy response. Not whitened:
    the greedy baseline already centres the signal per prompt."""
    b = np.asarray(baselines, dtype=np.float64)
    if b.ndim != 1 or b.size != len(token_rewards):
        raise ValueError(
            f"baselines of shape {b.shape} for {len(token_rewards)} responses: need one "
            "greedy-response reward per response"
        )
    _check_finite(b, "baselines")
    out = []
    for rewards, base in zip(token_rewards, b.tolist(), strict=True):
        r = np.asarray(rewards, dtype=np.float64)
        out.append(np.cumsum(r[::-1])[::-1] - base)
    return out


def token_advantages(
    estimator: str,
    token_rewards: Sequence[npt.ArrayLike],
    group_ids: npt.ArrayLike,
    *,
    gamma: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    baselines: npt.ArrayLike | None = None,
    masks: Sequence[npt.ArrayLike] | None = None,
) -> list[FloatArray]:
    """Per-token advantages of every response by estimator name, from token-level rewards
    (the outcome estimators score a response by the sum of its token rewards, as verl).
    `baselines`: remax only, each response's greedy-response reward. `masks` (bool, one per
    response token; multi-turn: False on tool tokens, whose rewards must be 0): the
    token-level estimators read the masked tokens only (REINFORCE++'s returns and whitening,
    its baseline variant's whitening, opo's lengths), as on the model's tokens alone; the
    outcome estimators are unchanged (the loss mask drops the other tokens)."""
    keep = _masks(token_rewards, masks)
    lengths = [int(np.asarray(t).size) for t in token_rewards]
    if estimator == "remax":
        if baselines is None:
            raise ValueError("adv_estimator 'remax' needs baselines (greedy-response rewards)")
        return remax_advantages(token_rewards, baselines)
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus_advantages(token_rewards, gamma, keep)
    scores = np.array([float(np.sum(t)) for t in token_rewards], dtype=np.float64)
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_plus_plus_baseline_advantages(scores, group_ids, lengths, keep)
    adv = compute_advantages(
        estimator,
        scores,
        group_ids,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        lengths=[int(m.sum()) for m in keep],  # opo's length weights: the model's tokens
    )
    return per_token(adv, lengths)


def _masks(
    arrays: Sequence[npt.ArrayLike], masks: Sequence[npt.ArrayLike] | None
) -> list[npt.NDArray[np.bool_]]:
    """`masks` as bool arrays, one per array of its length (None: all True)."""
    if masks is None:
        return [np.ones(np.asarray(a).size, dtype=bool) for a in arrays]
    out = [np.asarray(m, dtype=bool) for m in masks]
    if len(out) != len(arrays) or any(
        m.shape != (np.asarray(a).size,) for m, a in zip(out, arrays, strict=True)
    ):
        raise ValueError("masks need one bool per response token of each response")
    return out


def _whiten(
    values: list[FloatArray],
    masks: Sequence[npt.NDArray[np.bool_]] | None = None,
    eps: float = 1e-8,
) -> list[FloatArray]:
    """(x - mean) / sqrt(unbiased var + eps) over all masked entries of all arrays (None: every
    entry), 0 on the others; fewer than two entries have no spread to whiten by and give
    zeros (verl raises there)."""
    keep = _masks(values, masks)
    flat = np.concatenate([v[m] for v, m in zip(values, keep, strict=True)]) if values else None
    if flat is None or flat.size < 2:
        return [np.zeros_like(v) for v in values]
    mean = flat.mean()
    var = np.square(flat - mean).mean() * flat.size / (flat.size - 1)
    scale = 1.0 / np.sqrt(var + eps)
    return [np.where(m, (v - mean) * scale, 0.0) for v, m in zip(values, keep, strict=True)]


@dataclass(frozen=True, slots=True)
class GroupFilter:
    """Which groups carry a learning signal. `keep[i]` is per sample; the group lists are in
    order of first appearance."""

    keep: npt.NDArray[np.bool_]
    kept_groups: list[object]
    dropped_groups: list[object]

    @property
    def num_kept(self) -> int:
        return len(self.kept_groups)

    @property
    def num_dropped(self) -> int:
        return len(self.dropped_groups)


def filter_zero_variance_groups(rewards: npt.ArrayLike, group_ids: npt.ArrayLike) -> GroupFilter:
    """DAPO dynamic sampling: drop groups whose rewards are all equal (all solved or all
    failed): every advantage there is 0, so they only dilute the batch. Equality is exact.
    Groups of one sample are dropped too (their advantage is 0 as well; verl keeps them)."""
    r, inverse, counts = _grouped(rewards, group_ids)
    lo = np.full(counts.size, np.inf)
    hi = np.full(counts.size, -np.inf)
    np.minimum.at(lo, inverse, r)
    np.maximum.at(hi, inverse, r)
    signal = hi > lo
    order = _first_appearance(inverse, counts.size)
    ids = np.asarray(group_ids).tolist()
    first = _first_index(inverse, counts.size)
    return GroupFilter(
        keep=signal[inverse],
        kept_groups=[ids[first[g]] for g in order if signal[g]],
        dropped_groups=[ids[first[g]] for g in order if not signal[g]],
    )


@dataclass(frozen=True, slots=True)
class Refill(Generic[G]):
    """What to train on after a round of dynamic sampling: `groups` (at most the target) and
    whether the batch is still short so the caller should generate another round."""

    groups: list[G]
    draw_more: bool
    num_surplus: int


def refill(kept: Sequence[G], target: int) -> Refill[G]:
    """Given every kept group accumulated so far (oldest first), say whether to draw more and
    trim to `target` groups (the newest surplus groups are the ones cut)."""
    if target < 1:
        raise ValueError(f"target must be >= 1 group, got {target}")
    return Refill(
        groups=list(kept[:target]),
        draw_more=len(kept) < target,
        num_surplus=max(len(kept) - target, 0),
    )


def _grouped(
    rewards: npt.ArrayLike, group_ids: npt.ArrayLike
) -> tuple[FloatArray, npt.NDArray[np.intp], FloatArray]:
    r = np.asarray(rewards, dtype=np.float64)
    ids = np.asarray(group_ids)
    if r.ndim != 1 or ids.shape != r.shape:
        raise ValueError(
            f"rewards of shape {r.shape} and group_ids of shape {ids.shape}: need two 1-D "
            "arrays of the same length, one entry per sample"
        )
    _check_finite(r, "rewards")
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    return r, inverse.reshape(-1), counts.astype(np.float64)


def _check_finite(values: FloatArray, name: str) -> None:
    """Raise ValueError naming the first entry of `values` that is not finite."""
    if not np.all(np.isfinite(values)):
        bad = int(np.flatnonzero(~np.isfinite(values))[0])
        raise ValueError(f"{name}[{bad}] = {values[bad]}; {name} must be finite")


def _group_sums(values: FloatArray, inverse: npt.NDArray[np.intp], num_groups: int) -> FloatArray:
    return np.bincount(inverse, weights=values, minlength=num_groups).astype(np.float64)


def _first_index(inverse: npt.NDArray[np.intp], num_groups: int) -> npt.NDArray[np.intp]:
    first = np.full(num_groups, inverse.size, dtype=np.intp)
    np.minimum.at(first, inverse, np.arange(inverse.size))
    return first


def _first_appearance(inverse: npt.NDArray[np.intp], num_groups: int) -> list[int]:
    return np.argsort(_first_index(inverse, num_groups), kind="stable").tolist()


def gae_advantages(
    rewards: Sequence[npt.ArrayLike],
    values: Sequence[npt.ArrayLike],
    *,
    gamma: float,
    lam: float,
    masks: Sequence[npt.ArrayLike] | None = None,
) -> tuple[list[FloatArray], list[FloatArray]]:
    """GAE (verl's `compute_gae_advantage_return`): per response, its per-token advantages and
    returns from token-level `rewards` and the critic's `values` (one entry per response token).
    Advantages are whitened over every token of the batch (verl's `masked_whiten`: mean 0,
    unbiased variance 1); with fewer than two tokens they are only centred. `masks` (bool, one
    per response token; multi-turn: False on tool tokens): the recursion skips the unmasked
    tokens (verl's: their values and TD errors are not used), the whitening reads the masked
    ones, and unmasked tokens get advantage 0 and return 0: as on the model's tokens alone."""
    import torch

    from patrl.trainer import gae

    lengths = [len(np.asarray(r)) for r in rewards]
    if len(values) != len(rewards) or any(
        len(np.asarray(v)) != n for v, n in zip(values, lengths, strict=True)
    ):
        raise ValueError("rewards and values need one entry per response token of each response")
    if min(lengths, default=0) < 1:
        raise ValueError(f"every response needs >= 1 token, got lengths {lengths}")
    keep = _masks(rewards, masks)
    width = max(lengths)
    r_pad, v_pad = np.zeros((len(lengths), width)), np.zeros((len(lengths), width))
    mask = np.zeros((len(lengths), width), dtype=bool)
    for i, (r, v, n, m) in enumerate(zip(rewards, values, lengths, keep, strict=True)):
        r_pad[i, :n], v_pad[i, :n], mask[i, :n] = r, v, m
    if not mask.any():
        raise ValueError("every response token is masked out: no token to estimate on")
    adv_t, ret_t = gae(
        torch.from_numpy(r_pad), torch.from_numpy(v_pad), torch.from_numpy(mask), gamma, lam
    )
    adv, ret = adv_t.numpy(), np.where(mask, ret_t.numpy(), 0.0)
    valid = adv[mask]
    centred = np.where(mask, adv - valid.mean(), 0.0)
    if valid.size > 1:
        centred = centred / np.sqrt(valid.var(ddof=1) + 1e-8)
    return [centred[i, :n] for i, n in enumerate(lengths)], [
        ret[i, :n] for i, n in enumerate(lengths)
    ]
