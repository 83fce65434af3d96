"""RL losses as pure functions of per-token tensors: PPO/GRPO surrogate, KL, aggregation.

Every function takes `[batch, tokens]` tensors plus a boolean `mask` of the tokens that count,
and follows verl's definitions (`verl/trainer/ppo/core_algos.py`). Given the *global* token /
sequence counts of the optimizer step, a micro-batch's loss is its exact share of the
full-batch loss, so summed micro-batch gradients reproduce the full-batch gradient.
See docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOSS_MODES = ("vanilla", "gspo", "cispo", "gpg", "sapo", "geo_mean", "clip_cov", "kl_cov")
# verl's policy losses patrl refuses, and why (none at present).
REFUSED_LOSS_MODES: dict[str, str] = {}
# verl's spellings are accepted beside k1/k2/k3: "kl" is k1, "mse" is k2, "low_var_kl" is k3;
# "abs" is |log pi - log pi_ref|.
KL_TYPES = {
    "k1": "k1",
    "kl": "k1",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
    "abs": "abs",
}
# exp() of a log-ratio beyond this is inf in fp32 long before it is meaningful.
_LOG_RATIO_CLAMP = 20.0


def check_agg_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; accepted: {', '.join(AGG_MODES)}")


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce per-token `values` to a scalar over the `mask`ed tokens.

    token-mean: masked sum / masked tokens; seq-mean-token-mean / seq-mean-token-sum: mean over
    sequences of each one's masked mean / sum; seq-mean-token-sum-norm (Dr.GRPO): mean over
    sequences of masked sum / `scale_factor` (None: the padded width, verl's default).
    `num_tokens` / `num_seqs` replace the local counts by the optimizer step's global ones; a
    sequence without a masked token never counts.
    """
    check_agg_mode(mode)
    mask_f = mask.to(values.dtype)
    # where(), not a product: a NaN in a padded position must not leak into the sum.
    masked = torch.where(mask, values, torch.zeros_like(values))
    if mode == "token-mean":
        if num_tokens is not None:
            return masked.sum() / max(num_tokens, 1.0)
        return masked.sum() / mask_f.sum().clamp(min=1.0)
    seq_tokens = mask_f.sum(dim=-1)
    seq_sums = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq_sums = seq_sums / seq_tokens.clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        seq_sums = seq_sums / (values.shape[-1] if scale_factor is None else scale_factor)
    if num_seqs is not None:
        return seq_sums.sum() / max(num_seqs, 1.0)
    return seq_sums.sum() / (seq_tokens > 0).sum().clamp(min=1).to(values.dtype)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain mean over masked tokens (the metric form; 0 when nothing is masked in)."""
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1).to(values.dtype)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs (Schulman's k1/k2/k3,
    verl's `kl_penalty`).

    k1 = log pi - log pi_ref;  abs = |k1|;  k2 = (log pi - log pi_ref)^2 / 2;
    k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1, clamped to [-10, 10] as verl does.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl type {kl_type!r}; accepted: {', '.join(KL_TYPES)}")
    kind = KL_TYPES[kl_type]
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    log_ratio = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


@dataclass(frozen=True, slots=True)
class CovSettings:
    """verl's `actor.policy_loss` settings of the covariance losses (its defaults)."""

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1


@dataclass(slots=True)
class PolicyLossStats:
    """Masked means over the loss tokens of one call (detached), for metrics."""

    clipfrac: torch.Tensor  # tokens where the trust-region clip was the active branch
    clipfrac_low: torch.Tensor  # ... at 1 - clip_ratio_low (negative advantage)
    clipfrac_high: torch.Tensor  # ... at 1 + clip_ratio_high (positive advantage)
    clipfrac_lower: torch.Tensor  # verl's name: the dual-clip bound -A * clip_ratio_c was active
    ppo_kl: torch.Tensor  # mean of (old - new) logprob: k1 estimate of KL(old || new)
    behav_capped: torch.Tensor  # tokens dropped by the behaviour-weight cap (decoupled PPO)
    behav_weight: torch.Tensor  # mean behaviour importance weight over the kept tokens


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
    agg_mode: str,
    loss_mode: str = "vanilla",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    behaviour_logprobs: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
    cov: CovSettings | None = None,
    num_valid: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO/GRPO clipped surrogate (verl's dual clip with `clip_ratio_c`), or with `loss_mode`
    "gspo" GSPO's sequence-level ratio (no dual clip); the loss and its stats. verl's other
    losses, by its names (r = exp(log pi - log pi_old), clamped at +-20 in the exponent):
    "cispo": -sg(clip(r, 1 - low, 1 + high)) * A * log pi; "gpg": -A * log pi; "sapo":
    -A * sigmoid(tau (r - 1)) * 4 / tau, tau = `tau_pos` where A > 0 else `tau_neg` (aggregate
    it seq-mean-token-mean, as verl does); "geo_mean" (GMPO): per sequence
    -mean_t(A) * exp(mean_t(sign(A) min(sign(A) log r, sign(A) clip(log r, -low, high)))), the
    mean over sequences (`agg_mode` unused; IS weights enter as their per-sequence geometric
    mean). The covariance losses (`cov`, verl's defaults when None) work on this call's tokens
    (a micro-batch, as in verl), with the unclamped ratio; c = (A - mean A)(log pi - mean log
    pi): "clip_cov" detaches max(int(clip_cov_ratio x n), 1) tokens drawn at random
    (`generator`) among those PPO did not clip with clip_cov_lb < c < clip_cov_ub; "kl_cov"
    adds ppo_kl_coef x |log r| to the PPO loss of the max(1, int(n x kl_cov_ratio)) tokens of
    largest c. n = `num_valid`, the call's loss tokens (None: counted, a host sync).

    `is_weights` (rollout correction, detached) multiply each token's loss before aggregation,
    as verl's `rollout_is_weights`. GSPO's `ppo_kl` is the unclamped mean log-ratio (verl's);
    the vanilla loss's is clamped at +-20 as its ratio is (verl's too).

    With `behaviour_logprobs` (decoupled PPO) `old_logprobs` are the proximal policy's and each
    token's loss is weighted by w = exp(old - behaviour); tokens with w > `behaviour_weight_cap`
    are masked out but stay in the denominator (reported as `behav_capped`). Formulas:
    docs/training.md. Raises ValueError for `clip_ratio_c <= 1` or a cap without behaviour.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (or None to disable), got {clip_ratio_c}")
    if behaviour_weight_cap is not None and behaviour_logprobs is None:
        raise ValueError("behaviour_weight_cap needs behaviour_logprobs (decoupled PPO)")
    if loss_mode in REFUSED_LOSS_MODES:
        raise ValueError(
            f"loss_mode {loss_mode!r} is not supported: {REFUSED_LOSS_MODES[loss_mode]}"
        )
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"unknown loss_mode {loss_mode!r}; accepted: {', '.join(LOSS_MODES)}")
    if loss_mode == "geo_mean":
        if behaviour_logprobs is not None:
            raise ValueError("loss_mode 'geo_mean' has no decoupled-PPO (behaviour) form")
        return _geo_mean_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            clip_ratio_low,
            clip_ratio_high,
            is_weights,
            num_seqs,
        )
    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    gspo = loss_mode == "gspo"
    covariance = loss_mode in ("clip_cov", "kl_cov")
    ratio = _gspo_ratio(logprobs, old_logprobs, mask) if gspo else log_ratio.exp()
    kl_values = old_logprobs - logprobs if gspo else -log_ratio
    if covariance:  # verl's covariance losses take the ratio unclamped
        raw = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
        ratio = raw.exp()
        kl_values = raw.abs() if loss_mode == "kl_cov" else -raw
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if loss_mode == "cispo":
        bounded = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
        loss_ppo = -bounded.detach() * advantages * logprobs
        clipped = ratio != bounded
    elif loss_mode == "gpg":
        loss_ppo = -logprobs * advantages
        clipped = torch.zeros_like(mask)
    elif loss_mode == "sapo":
        tau = torch.where(
            advantages > 0,
            torch.as_tensor(tau_pos, dtype=ratio.dtype, device=ratio.device),
            torch.as_tensor(tau_neg, dtype=ratio.dtype, device=ratio.device),
        )
        loss_ppo = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages
        clipped = torch.zeros_like(mask)
    elif covariance:
        settings = cov or CovSettings()
        n = int(mask.sum()) if num_valid is None else num_valid
        if loss_mode == "clip_cov":
            dropped = _clip_cov_tokens(
                logprobs, advantages, mask, clipped & mask, settings, n, generator
            )
            loss_ppo = torch.where(dropped, loss_ppo * 0.0, loss_ppo)
            clipped = dropped  # verl's pg_clipfrac: the tokens clip_cov detached
        else:
            top = _kl_cov_tokens(logprobs, advantages, mask, settings.kl_cov_ratio, n)
            loss_ppo = torch.where(
                top, loss_unclipped + settings.ppo_kl_coef * raw.abs(), loss_unclipped
            )
            clipped = torch.zeros_like(mask)
    dual = torch.zeros_like(clipped)
    if clip_ratio_c is not None and loss_mode == "vanilla":
        loss_dual = -advantages * clip_ratio_c
        dual = (loss_ppo > loss_dual) & (advantages < 0)
        loss_ppo = torch.where(dual, loss_dual, loss_ppo)

    keep = mask
    capped = torch.zeros_like(mask)
    weight = torch.ones_like(loss_ppo)
    if behaviour_logprobs is not None:
        behav_log_w = (old_logprobs - behaviour_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        weight = behav_log_w.exp()
        if behaviour_weight_cap is not None:
            capped = mask & (weight > behaviour_weight_cap)
            keep = mask & ~capped
        loss_ppo = loss_ppo * weight.detach()
    if is_weights is not None:
        loss_ppo = loss_ppo * is_weights.detach()
    loss_ppo = torch.where(keep, loss_ppo, torch.zeros_like(loss_ppo))
    loss = aggregate(loss_ppo, mask, agg_mode, num_tokens, num_seqs, scale_factor)

    with torch.no_grad():
        stats = PolicyLossStats(
            clipfrac=masked_mean(clipped.float(), mask),
            clipfrac_low=masked_mean((clipped & (advantages < 0)).float(), mask),
            clipfrac_high=masked_mean((clipped & (advantages > 0)).float(), mask),
            clipfrac_lower=masked_mean(dual.float(), mask),
            ppo_kl=masked_mean(kl_values, mask),
            behav_capped=masked_mean(capped.float(), mask),
            behav_weight=masked_mean(weight, keep),
        )
    return loss, stats


def _covariance(
    logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(A - mean A)(log pi - mean log pi) per token, means over the masked tokens."""
    lp = logprobs.detach()
    return (advantages - masked_mean(advantages, mask)) * (lp - masked_mean(lp, mask))


def _clip_cov_tokens(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clipped_by_ppo: torch.Tensor,
    cov: CovSettings,
    num_valid: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """verl's clip_cov selection: min(max(int(ratio x n), 1), candidates) tokens drawn at
    random among the candidates (masked, not clipped by PPO, lb < c < ub)."""
    c = _covariance(logprobs, advantages, mask)
    candidates = mask & ~clipped_by_ppo & (c < cov.clip_cov_ub) & (c > cov.clip_cov_lb)
    if num_valid == 0:
        return torch.zeros_like(mask)
    count = min(max(int(cov.clip_cov_ratio * num_valid), 1), mask.numel())
    keys = torch.rand(mask.shape, generator=generator, device=mask.device)
    keys = torch.where(candidates, keys, torch.full_like(keys, -1.0))
    picked = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    picked[keys.reshape(-1).topk(count).indices] = True
    return picked.view_as(mask) & candidates


def _kl_cov_tokens(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ratio: float,
    num_valid: int,
) -> torch.Tensor:
    """verl's kl_cov selection: the max(1, int(n x ratio)) masked tokens of largest c."""
    if num_valid == 0:
        return torch.zeros_like(mask)
    c = _covariance(logprobs, advantages, mask)
    c = torch.where(mask, c, torch.full_like(c, float("-inf")))
    count = min(max(1, int(num_valid * ratio)), num_valid)
    picked = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    picked[c.reshape(-1).topk(count).indices] = True
    return picked.view_as(mask) & mask


def _geo_mean_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
    is_weights: torch.Tensor | None,
    num_seqs: float | None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """verl's `compute_policy_loss_geo_mean` (GMPO), the mean taken over the step's
    `num_seqs` sequences (None: this call's rows) so micro-batches add up to the batch's."""
    zero = torch.zeros_like(logprobs)
    n = mask.sum(dim=-1).to(logprobs.dtype)
    neg_kl = torch.where(mask, logprobs - old_logprobs, zero)
    sign = torch.sign(advantages)
    bounded = neg_kl.clamp(-low, high)
    chosen = sign * torch.minimum(sign * neg_kl, sign * bounded)
    ratio = torch.exp(torch.where(mask, chosen, zero).sum(dim=-1) / (n + 1e-8))
    adv = torch.where(mask, advantages, zero).sum(dim=-1) / (n + 1e-8)
    per_seq = -adv * ratio
    if is_weights is not None:
        log_w = torch.where(mask, torch.log(is_weights.detach() + 1e-10), zero)
        per_seq = per_seq * torch.exp(log_w.sum(dim=-1) / (n + 1e-8))
    denom = float(logprobs.shape[0]) if num_seqs is None else max(num_seqs, 1.0)
    loss = per_seq.sum() / denom
    with torch.no_grad():
        clipped = neg_kl != bounded
        high_clip = masked_mean((clipped & (advantages > 0)).float(), mask)
        low_clip = masked_mean((clipped & (advantages < 0)).float(), mask)
        none = torch.zeros_like(high_clip)
        stats = PolicyLossStats(
            clipfrac=high_clip,  # verl's pg_clipfrac: clipped where A > 0
            clipfrac_low=low_clip,
            clipfrac_high=high_clip,
            clipfrac_lower=low_clip,  # verl's pg_clipfrac_lower: clipped where A < 0
            ppo_kl=masked_mean(-neg_kl, mask),
            behav_capped=none,
            behav_weight=torch.ones_like(none),
        )
    return loss, stats


def reinforce_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg_mode: str,
    is_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    scale_factor: float | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """verl's `compute_policy_loss_reinforce` (rollout correction's bypass mode,
    `loss_type=reinforce`): agg(-A * log pi * w), w the detached IS weights (None: 1). No
    clipping; `ppo_kl` is mean(log pi_rollout - log pi)."""
    loss_tok = -advantages * logprobs
    if is_weights is not None:
        loss_tok = loss_tok * is_weights.detach()
    loss = aggregate(loss_tok, mask, agg_mode, num_tokens, num_seqs, scale_factor)
    with torch.no_grad():
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        stats = PolicyLossStats(
            clipfrac=zero,
            clipfrac_low=zero,
            clipfrac_high=zero,
            clipfrac_lower=zero,
            ppo_kl=masked_mean(rollout_logprobs - logprobs, mask),
            behav_capped=zero,
            behav_weight=torch.ones_like(zero),
        )
    return loss, stats


def _gspo_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's token-level view of the sequence ratio s_i = exp(mean_t(log pi - log pi_old)):
    forward value s_i on every token, gradient that of pi_t / sg(pi_t) (verl's form, log
    clamped above at 10)."""
    diff = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    seq = diff.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(diff.dtype)
    log_ratio = logprobs - logprobs.detach() + seq.detach().unsqueeze(-1)
    return log_ratio.clamp(max=10.0).exp()


@dataclass(slots=True)
class ValueLossStats:
    """Masked means over the value tokens of one call (detached), for metrics."""

    clipfrac: torch.Tensor  # tokens where the clipped prediction gave the larger loss
    vpred_mean: torch.Tensor  # mean predicted value


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange_value: float,
    agg_mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, ValueLossStats]:
    """verl's `compute_value_loss`: 0.5 * agg(max((v - R)^2, (clip(v, V - c, V + c) - R)^2)),
    `values` V being the critic's before the update and `returns` R the GAE returns."""
    if cliprange_value <= 0:
        raise ValueError(f"cliprange_value must be > 0, got {cliprange_value}")
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns).square()
    loss_clipped = (clipped - returns).square()
    loss = 0.5 * aggregate(
        torch.maximum(loss_unclipped, loss_clipped), mask, agg_mode, num_tokens, num_seqs
    )
    with torch.no_grad():
        stats = ValueLossStats(
            clipfrac=masked_mean((loss_clipped > loss_unclipped).float(), mask),
            vpred_mean=masked_mean(vpreds, mask),
        )
    return loss, stats
