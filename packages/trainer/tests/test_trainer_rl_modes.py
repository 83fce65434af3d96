"""GSPO, seq-mean-token-sum-norm and the abs KL penalty against plain Python loops, and against
verl's formulas (transcribed from verl/trainer/ppo/core_algos.py) on the same inputs."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from patrl.trainer import TrainerConfig, aggregate, kl_penalty, policy_loss

# Three responses padded to 5 tokens: lengths 4, 1 (a length-1 response) and 0 (all padding).
LENGTHS = (4, 1, 0)
MASK = torch.tensor([[i < n for i in range(5)] for n in LENGTHS])


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    logp = old + 0.4 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    logp[~MASK] = float("nan")  # padding must never leak into a loss
    return logp, old, adv


def _gspo_loop(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, low: float, high: float
) -> float:
    """GSPO (seq-mean-token-mean): per sequence s = exp(mean log-ratio), per token
    max(-A s, -A clip(s)), mean over the sequence's tokens, mean over sequences."""
    per_seq = []
    for b, n in enumerate(LENGTHS):
        if n == 0:
            continue
        mean_log = sum(float(logp[b, t] - old[b, t]) for t in range(n)) / n
        s = math.exp(min(mean_log, 10.0))
        terms = [
            max(-float(adv[b, t]) * s, -float(adv[b, t]) * min(max(s, 1 - low), 1 + high))
            for t in range(n)
        ]
        per_seq.append(sum(terms) / n)
    return sum(per_seq) / len(per_seq)


def test_gspo_loss_matches_loop_twin() -> None:
    logp, old, adv = _inputs()
    loss, stats = policy_loss(
        logp,
        old,
        adv,
        MASK,
        clip_ratio_low=0.05,
        clip_ratio_high=0.08,
        clip_ratio_c=3.0,
        agg_mode="seq-mean-token-mean",
        loss_mode="gspo",
    )
    assert loss.item() == pytest.approx(_gspo_loop(logp, old, adv, 0.05, 0.08), rel=1e-12)
    assert stats.clipfrac_lower.item() == 0.0  # GSPO has no dual clip


def test_gspo_gradient_is_the_sequence_ratio_times_token_gradient() -> None:
    """d loss / d logp[b, t] = -A[b, t] * s_b / (n_b * num_seqs) where unclipped (GSPO eq. 10)."""
    logp, old, adv = _inputs(1)
    logp = torch.where(MASK, logp, torch.zeros_like(logp)).requires_grad_(True)
    big = 10.0  # no clipping: every token on the unclipped branch
    loss, _ = policy_loss(
        logp,
        old,
        adv,
        MASK,
        clip_ratio_low=0.99,
        clip_ratio_high=big,
        clip_ratio_c=None,
        agg_mode="seq-mean-token-mean",
        loss_mode="gspo",
    )
    loss.backward()
    assert logp.grad is not None
    for b, n in enumerate(LENGTHS):
        for t in range(5):
            if t >= n:
                assert logp.grad[b, t].item() == 0.0
                continue
            s = math.exp(sum(float(logp[b, k].detach() - old[b, k]) for k in range(n)) / n)
            want = -float(adv[b, t]) * s / (n * 2)
            assert logp.grad[b, t].item() == pytest.approx(want, rel=1e-10)


def _verl_agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """verl's agg_loss (seq-mean modes: sum over sequences / batch size, the newer form with
    loss_scale_factor None)."""
    if mode == "seq-mean-token-mean":
        seq = torch.sum(loss_mat * loss_mask, dim=-1) / torch.sum(loss_mask, dim=-1)
        return torch.mean(seq)
    assert mode == "seq-mean-token-sum-norm"
    seq = torch.sum(loss_mat * loss_mask, dim=-1) / loss_mask.shape[-1]
    return torch.sum(seq) / loss_mat.shape[0]


def _verl_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's compute_policy_loss_gspo (loss and pg_clipfrac), transcribed."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = (
        log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    )
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(
        seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high
    )
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = _verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    mask = response_mask
    pg_clipfrac = (torch.gt(pg_losses2, pg_losses1).float() * mask).sum() / mask.sum()
    return pg_loss, pg_clipfrac


def test_gspo_matches_verl_on_the_same_inputs() -> None:
    """verl's layout has no empty rows (its masked mean would be 0/0 there): two full rows."""
    logp, old, adv = _inputs(2)
    mask = MASK[:2].clone()
    logp, old, adv = logp[:2].nan_to_num(0.0), old[:2], adv[:2]
    ours, stats = policy_loss(
        logp.clone().requires_grad_(True),
        old,
        adv,
        mask,
        clip_ratio_low=3e-4,
        clip_ratio_high=4e-4,
        clip_ratio_c=3.0,
        agg_mode="seq-mean-token-mean",
        loss_mode="gspo",
    )
    theirs, clipfrac = _verl_gspo(old, logp, adv, mask.double(), 3e-4, 4e-4)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    assert stats.clipfrac.item() == pytest.approx(clipfrac.item(), rel=1e-6)  # fp32 metric


def _sum_norm_loop(values: torch.Tensor, scale: float) -> float:
    seqs = [sum(float(values[b, t]) for t in range(n)) / scale for b, n in enumerate(LENGTHS) if n]
    return sum(seqs) / len(seqs)


def test_seq_mean_token_sum_norm_matches_loop_twin() -> None:
    values, _, _ = _inputs(3)
    got = aggregate(values, MASK, "seq-mean-token-sum-norm", scale_factor=7.0)
    assert got.item() == pytest.approx(_sum_norm_loop(values, 7.0), rel=1e-12)
    # None divides by the padded width (verl's loss_mask.shape[-1])
    got = aggregate(values, MASK, "seq-mean-token-sum-norm")
    assert got.item() == pytest.approx(_sum_norm_loop(values, 5.0), rel=1e-12)


def test_seq_mean_token_sum_norm_global_counts_split_exactly() -> None:
    """Two micro-batches with the step's global sequence count and scale sum to the whole."""
    values, _, _ = _inputs(4)
    values = values.nan_to_num(0.0)
    whole = aggregate(values, MASK, "seq-mean-token-sum-norm", num_seqs=2.0, scale_factor=9.0)
    parts = sum(
        aggregate(values[r], MASK[r], "seq-mean-token-sum-norm", num_seqs=2.0, scale_factor=9.0)
        for r in (slice(0, 1), slice(1, 3))
    )
    assert float(parts) == pytest.approx(whole.item(), rel=1e-12)


def test_seq_mean_token_sum_norm_matches_verl() -> None:
    values, _, _ = _inputs(5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    ours = aggregate(values.nan_to_num(0.0), mask, "seq-mean-token-sum-norm")
    theirs = _verl_agg_loss(values.nan_to_num(0.0), mask.double(), "seq-mean-token-sum-norm")
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)


def test_abs_kl_penalty_matches_loop_and_verl() -> None:
    logp, old, _ = _inputs(6)
    got = kl_penalty(logp, old, "abs")
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            assert got[b, t].item() == abs(float(logp[b, t]) - float(old[b, t]))
    assert torch.equal(got[MASK], (logp - old).abs()[MASK])


def test_clip_ratio_is_the_default_for_low_and_high() -> None:
    cfg = TrainerConfig(clip_ratio=0.3)
    assert (cfg.clip_low, cfg.clip_high) == (0.3, 0.3)
    cfg = TrainerConfig(clip_ratio=0.3, clip_ratio_high=0.28)
    assert (cfg.clip_low, cfg.clip_high) == (0.3, 0.28)
    assert (TrainerConfig().clip_low, TrainerConfig().clip_high) == (0.2, 0.2)


def test_unknown_loss_mode_is_named() -> None:
    with pytest.raises(ValidationError, match="loss_mode"):
        TrainerConfig.model_validate({"policy_loss": {"loss_mode": "ppo2"}})
    logp, old, adv = _inputs()
    with pytest.raises(ValueError, match=r"'ppo2'.*vanilla, gspo"):
        policy_loss(
            logp,
            old,
            adv,
            MASK,
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            clip_ratio_c=None,
            agg_mode="token-mean",
            loss_mode="ppo2",
        )
