"""Rollout-training mismatch correction (verl's `algorithm.rollout_correction`): truncated
importance-sampling weights (TIS), rejection masks (MIS) and the mismatch metrics.

The engine samples with one kernel stack and the trainer scores with another; the two
policies' logprobs of the same tokens differ (in bf16 on GPUs enough to collapse runs). With
`log_ratio = log pi_train - log pi_rollout` per response token:

- IS weights (`rollout_is`): `token`: w_t = min(exp(log_ratio_t), threshold); `sequence`:
  w = min(exp(sum_t log_ratio_t), threshold) on every token of the sequence. Exponents are
  clamped to +-20 first; weights are 0 outside the mask and detached; `batch_normalize`
  divides them by their mean (over tokens, or over sequences for `sequence`).
- Rejection (`rollout_rs`, comma-separated options, all must pass): per-token divergences
  k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio, compared per
  token (`token_k*`) or as a sequence's sum, mean or max (`seq_sum_k*`, `seq_mean_k*`,
  `seq_max_k*`). k1 options keep [log lower, log upper] (threshold "lower_upper", or one
  upper u with lower 1/u); the others keep values <= the threshold.

Every formula is verl's (`verl/trainer/ppo/rollout_corr_helper.py`); metric names are verl's
without the `rollout_corr/` prefix, which `correction` adds. Tensors are `[batch, tokens]`,
`mask` boolean; nothing here syncs with the host except the returned metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SAFETY_BOUND = 20.0
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True, slots=True)
class RSOption:
    """One rejection criterion: its name and bounds (lower only for k1 options, as ratios)."""

    name: str
    lower: float | None
    upper: float


def parse_rs(rollout_rs: str, threshold: str | float | None) -> list[RSOption]:
    """verl's `rollout_rs` (comma-separated options, repeats dropped) with their thresholds:
    one value for all options or one per option, comma-separated. Raises ValueError naming the
    option or value that is wrong and what is accepted."""
    names = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    if not names:
        raise ValueError(f"rollout_rs={rollout_rs!r} names no option; accepted: {RS_OPTIONS}")
    for name in names:
        if name not in RS_OPTIONS:
            raise ValueError(f"rollout_rs option {name!r} is unknown; accepted: {RS_OPTIONS}")
    if threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold={threshold!r}: a number or a string")
    specs = (
        [str(threshold)]
        if not isinstance(threshold, str)
        else [p.strip() for p in threshold.split(",") if p.strip()]
    )
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"rollout_rs_threshold={threshold!r}: one threshold for all {len(names)} options "
            f"or one per option ({names})"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    return [_option(name, spec) for name, spec in zip(names, specs, strict=True)]


def _option(name: str, spec: str) -> RSOption:
    try:
        if name.endswith("k1"):
            lo, sep, hi = spec.partition("_")
            upper = float(hi if sep else lo)
            lower = float(lo) if sep else 1.0 / upper
        else:
            if "_" in spec:
                raise ValueError
            lower, upper = None, float(spec)
    except (ValueError, ZeroDivisionError):
        form = "'upper' or 'lower_upper'" if name.endswith("k1") else "one upper bound"
        raise ValueError(
            f"rollout_rs_threshold {spec!r} for {name}: expected {form}, positive numbers"
        ) from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: bounds must be positive")
    return RSOption(name, lower, upper)


def _mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked_mean over everything (the 1e-8 keeps an empty mask at 0)."""
    return torch.where(mask, values, torch.zeros_like(values)).sum() / (
        mask.sum().to(values.dtype) + 1e-8
    )


def _row_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum(dim=-1)


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _row_sum(values, mask) / (mask.sum(dim=-1).to(values.dtype) + 1e-8)


def is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: float,
    batch_normalize: bool = False,
    all_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated IS weights (detached, 0 outside `mask`, at most `threshold` before
    normalisation) and verl's `rollout_is_*` metrics (0-dim tensors; `all_metrics` False:
    `rollout_is_mean` only, the weights' mean before truncation)."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r}; accepted: {IS_LEVELS} or null")
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    log_ratio = log_ratio.detach()
    fmask = mask.to(log_ratio.dtype)
    if level == "token":
        for_metrics = log_ratio
        weights = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    else:
        for_metrics = _row_sum(log_ratio, mask).unsqueeze(-1)
        weights = for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio)
    weights = weights * fmask
    if all_metrics:
        metrics = _is_metrics(weights, for_metrics, mask, level, threshold)
    else:
        metrics = {"rollout_is_mean": _mean(weights, mask)}
    weights = weights.clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            mean = _mean(weights, mask)
        else:
            seq_mask = mask.any(dim=-1).to(weights.dtype)
            mean = (_row_mean(weights, mask) * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        ok = mean > 1e-8
        weights = torch.where(ok, weights / mean.clamp_min(1e-8), weights)
        metrics["rollout_is_batch_norm_factor"] = torch.where(ok, mean, torch.ones_like(mean))
    return weights, metrics


def _is_metrics(
    weights: torch.Tensor,
    for_metrics: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: float,
) -> dict[str, torch.Tensor]:
    lower = 1.0 / threshold
    m: dict[str, torch.Tensor] = {"rollout_is_mean": _mean(weights, mask)}
    if level == "sequence":
        # verl takes these over every row's sum, padding rows included
        m["rollout_is_max"] = for_metrics.max().clamp(max=SAFETY_BOUND).exp()
        m["rollout_is_min"] = for_metrics.min().exp()
        m["rollout_is_ratio_fraction_high"] = (for_metrics > math.log(threshold)).float().mean()
        m["rollout_is_ratio_fraction_low"] = (for_metrics < math.log(lower)).float().mean()
    else:
        m["rollout_is_ratio_fraction_high"] = _mean((weights > threshold).float(), mask)
        m["rollout_is_ratio_fraction_low"] = _mean((weights < lower).float(), mask)
        m["rollout_is_max"] = weights.masked_fill(~mask, float("-inf")).max()
        m["rollout_is_min"] = weights.masked_fill(~mask, float("inf")).min()
    clamped = weights.clamp(min=lower, max=threshold)
    mean_c = _mean(clamped, mask)
    std = (_mean(clamped.square(), mask) - mean_c.square()).clamp(min=0).sqrt()
    m["rollout_is_std"] = torch.where(mask.sum() > 1, std, torch.zeros_like(std))
    normed = clamped / (mean_c + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / _mean(normed.square(), mask)
    seq = _row_mean(weights, mask)
    m["rollout_is_seq_mean"] = seq.mean()
    m["rollout_is_seq_max"] = seq.max()
    m["rollout_is_seq_min"] = seq.min()
    m["rollout_is_seq_max_deviation"] = (seq - 1.0).abs().max()
    m["rollout_is_seq_fraction_high"] = (seq > threshold).float().mean()
    m["rollout_is_seq_fraction_low"] = (seq < lower).float().mean()
    return m


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, options: list[RSOption]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The tokens every option keeps (`mask` and the options' keeps) and verl's masked
    fractions: per option `rollout_rs_<name>_masked_fraction` (tokens) and
    `..._seq_masked_fraction` (sequences), and the combined `rollout_rs_masked_fraction` and
    `rollout_rs_seq_masked_fraction` (sequences with any rejected token, over all rows)."""
    lr = log_ratio.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": lr.exp() - 1.0 - lr}
    seq_valid = mask.any(dim=-1)
    keep_all = torch.ones_like(mask)
    metrics: dict[str, torch.Tensor] = {}
    for opt in options:
        kind = opt.name[-2:]
        stat = per_token[kind]
        if opt.name.startswith("seq_sum"):
            stat = _row_sum(stat, mask).unsqueeze(-1)
        elif opt.name.startswith("seq_mean"):
            stat = _row_mean(stat, mask).unsqueeze(-1)
        elif opt.name.startswith("seq_max"):
            top = stat.masked_fill(~mask, float("-inf")).max(dim=-1).values
            stat = torch.where(top == float("-inf"), torch.zeros_like(top), top).unsqueeze(-1)
        if opt.lower is not None:
            keep = (stat >= math.log(opt.lower)) & (stat <= math.log(opt.upper))
        else:
            keep = stat <= opt.upper
        keep = keep.expand_as(mask)
        keep_all = keep_all & keep
        seq_keep = (keep | ~mask).all(dim=-1)
        metrics[f"rollout_rs_{opt.name}_masked_fraction"] = _mean((~keep).to(lr.dtype), mask)
        valid = seq_valid.to(lr.dtype)
        metrics[f"rollout_rs_{opt.name}_seq_masked_fraction"] = (
            (~seq_keep).to(lr.dtype) * valid
        ).sum() / valid.sum().clamp(min=1.0)
        metrics[f"rollout_rs_{opt.name}_mean"] = _mean(stat.expand_as(lr), mask)
    metrics["rollout_rs_masked_fraction"] = _mean((~keep_all).to(lr.dtype), mask)
    metrics["rollout_rs_seq_masked_fraction"] = (mask & ~keep_all).any(dim=-1).to(lr.dtype).mean()
    return mask & keep_all, metrics


def offpolicy_metrics(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """verl's `compute_offpolicy_metrics`: the mismatch between the trainer's and the
    rollout's logprobs of the same tokens. Token level: `kl` = mean(log pi_rollout - log
    pi_train) (KL(rollout || train), k1), `k3_kl`, `chi2_token`; sequence level:
    `log_ppl_diff` (mean over sequences of the difference of mean token logprobs, rollout minus
    train) with its abs/max/min, `ppl_ratio`, `chi2_seq`; perplexities of both."""
    train_logp, rollout_logp = train_logp.detach(), rollout_logp.detach()
    m: dict[str, torch.Tensor] = {}
    mean_train = _row_mean(train_logp, mask)
    m["training_ppl"] = (-mean_train).exp().mean()
    m["training_log_ppl"] = (-mean_train).mean()
    m["kl"] = _mean(rollout_logp - train_logp, mask)
    log_ratio = train_logp - rollout_logp
    m["k3_kl"] = _mean(log_ratio.exp() - log_ratio - 1, mask)
    mean_rollout = _row_mean(rollout_logp, mask)
    m["rollout_ppl"] = (-mean_rollout).exp().mean()
    m["rollout_log_ppl"] = (-mean_rollout).mean()
    diff = mean_rollout - mean_train
    m["log_ppl_diff"] = diff.mean()
    m["log_ppl_abs_diff"] = diff.abs().mean()
    m["log_ppl_diff_max"] = diff.max()
    m["log_ppl_diff_min"] = diff.min()
    m["ppl_ratio"] = diff.exp().mean()
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_token"] = _mean(safe.exp().square(), mask) - 1.0
    seq_sum = _row_sum(log_ratio, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = (2.0 * seq_sum).exp().mean() - 1.0
    return m


def ragged_offpolicy_metrics(
    train_rows: list[torch.Tensor], rollout_rows: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`offpolicy_metrics` of rows of different lengths (each row's response tokens), without
    padding them to the longest: a batch of long responses holds only its own tokens. Rows
    must be non-empty; values as `offpolicy_metrics` gives for the padded batch."""
    lengths = torch.tensor([t.numel() for t in train_rows])
    if len(train_rows) != len(rollout_rows) or any(
        a.numel() != b.numel() for a, b in zip(train_rows, rollout_rows, strict=True)
    ):
        raise ValueError("train and rollout logprobs need the same number of tokens per row")
    if int(lengths.min()) < 1:
        raise ValueError("every row needs at least one token")
    train = torch.cat([t.detach().double().reshape(-1) for t in train_rows])
    rollout = torch.cat([t.detach().double().reshape(-1) for t in rollout_rows])
    rows = torch.repeat_interleave(torch.arange(len(train_rows)), lengths)
    n_rows = len(train_rows)

    def row_sum(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_rows, dtype=values.dtype).index_add_(0, rows, values)

    count = lengths.to(torch.float64)
    tokens = float(train.numel())
    m: dict[str, torch.Tensor] = {}
    mean_train = row_sum(train) / (count + 1e-8)
    m["training_ppl"] = (-mean_train).exp().mean()
    m["training_log_ppl"] = (-mean_train).mean()
    m["kl"] = (rollout - train).sum() / (tokens + 1e-8)
    log_ratio = train - rollout
    m["k3_kl"] = (log_ratio.exp() - log_ratio - 1).sum() / (tokens + 1e-8)
    mean_rollout = row_sum(rollout) / (count + 1e-8)
    m["rollout_ppl"] = (-mean_rollout).exp().mean()
    m["rollout_log_ppl"] = (-mean_rollout).mean()
    diff = mean_rollout - mean_train
    m["log_ppl_diff"] = diff.mean()
    m["log_ppl_abs_diff"] = diff.abs().mean()
    m["log_ppl_diff_max"] = diff.max()
    m["log_ppl_diff_min"] = diff.min()
    m["ppl_ratio"] = diff.exp().mean()
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_token"] = safe.exp().square().sum() / (tokens + 1e-8) - 1.0
    seq_sum = row_sum(log_ratio).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = (2.0 * seq_sum).exp().mean() - 1.0
    return m


def correction(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_is: str | None,
    rollout_is_threshold: float,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """verl's `compute_rollout_correction_and_rejection_mask`: the IS weights (None when
    `rollout_is` is None), the mask with rejected tokens removed, and every metric as
    `rollout_corr/<name>` floats (one host read)."""
    if not bool(mask.any()):
        raise ValueError("rollout correction needs at least one response token in the mask")
    log_ratio = (train_logp - rollout_logp).detach()
    metrics: dict[str, torch.Tensor] = {}
    weights = None
    if rollout_is is not None:
        weights, is_m = is_weights(
            log_ratio, mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics.update(is_m)
    kept = mask
    if rollout_rs is not None:
        kept, rs_m = rejection_mask(log_ratio, mask, parse_rs(rollout_rs, rollout_rs_threshold))
        metrics.update(rs_m)
    metrics.update(offpolicy_metrics(train_logp, rollout_logp, mask))
    names = list(metrics)
    values = torch.stack([metrics[k].double() for k in names]).tolist()
    return weights, kept, {f"rollout_corr/{k}": v for k, v in zip(names, values, strict=True)}
