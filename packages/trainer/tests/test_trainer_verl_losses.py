"""verl's other policy losses (cispo, gpg, sapo, geo_mean, clip_cov, kl_cov) against plain Python loops and
against verl's functions transcribed from verl/trainer/ppo/core_algos.py (commit b178a3c) on
the same inputs."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_testkit import make_batch, tiny_llama

from patrl.trainer import Trainer, TrainerConfig, policy_loss
from patrl.trainer.config import PolicyLossConfig
from patrl.trainer.losses import CovSettings

# Three responses padded to 5 tokens (lengths 5, 3, 1): verl's layout has no empty rows.
LENGTHS = (5, 3, 1)
MASK = torch.tensor([[t < n for t in range(5)] for n in LENGTHS])
FMASK = MASK.double()
LOW, HIGH = 0.2, 0.28


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    logp = old + 0.4 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv[1] = adv[1].abs()  # some sequences all positive, some all negative
    adv[2] = -adv[2].abs()
    return logp, old, adv


def _ours(
    mode: str, seed: int, agg: str = "token-mean", **kw: object
) -> tuple[torch.Tensor, torch.Tensor, object]:
    logp, old, adv = _inputs(seed)
    logp = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(
        logp,
        old,
        adv,
        MASK,
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
        clip_ratio_c=3.0,
        agg_mode=agg,
        loss_mode=mode,
        **kw,  # type: ignore[arg-type]
    )
    loss.backward()
    assert logp.grad is not None
    return loss, logp.grad, stats


def _verl_masked_mean(
    values: torch.Tensor, mask: torch.Tensor, axis: int | None = None
) -> torch.Tensor:
    v = torch.where(mask.bool(), values, 0.0) * mask
    if axis is None:
        return v.sum() / (mask.sum() + 1e-8)
    return v.sum(axis) / (mask.sum(axis) + 1e-8)


def _verl_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (torch.where(mask.bool(), loss_mat, 0.0) * mask).sum() / mask.sum()


def _verl_seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    seq_mask = torch.sum(mask, dim=-1)
    seq_losses = torch.sum(loss_mat * mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def _verl_cispo(
    old: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - LOW, 1 + HIGH)
    pg_losses = -clipped_ratio.detach() * adv * logp
    return _verl_token_mean(pg_losses, mask)


def _verl_gpg(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _verl_token_mean(-logp * adv, mask)


def _verl_sapo(
    old: torch.Tensor,
    logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
) -> torch.Tensor:
    tp = torch.as_tensor(tau_pos, dtype=adv.dtype)
    tn = torch.as_tensor(tau_neg, dtype=adv.dtype)

    def gate_function(x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(tau * (x - 1.0)) * (4.0 / tau)

    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    taus = torch.where(condition=adv > 0, input=tp, other=tn)
    pg_losses = -gate_function(ratio, taus) * adv
    return _verl_seq_mean_token_mean(pg_losses, mask)


def _verl_geo_mean(
    old: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    negative_approx_kl = logp - old
    sgn_advantage = torch.sign(adv)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -LOW, HIGH)
    negative_approx_kl_min = torch.min(
        sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp
    )
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (adv * mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    return torch.mean(-advantage * ratio)


def _verl_grad(fn, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    old, logp, adv = args
    logp = logp.clone().requires_grad_(True)
    loss = fn(old, logp, adv, FMASK)
    loss.backward()
    assert logp.grad is not None
    return loss, logp.grad


@pytest.mark.parametrize(
    ("mode", "agg", "verl"),
    [
        ("cispo", "token-mean", _verl_cispo),
        ("gpg", "token-mean", lambda o, lp, a, m: _verl_gpg(lp, a, m)),
        ("sapo", "seq-mean-token-mean", lambda o, lp, a, m: _verl_sapo(o, lp, a, m, 1.0, 1.05)),
        ("geo_mean", "token-mean", _verl_geo_mean),
    ],
)
def test_loss_and_gradient_match_verl(mode: str, agg: str, verl) -> None:  # type: ignore[no-untyped-def]
    ours, grad, _ = _ours(mode, 0, agg)
    logp, old, adv = _inputs(0)
    theirs, their_grad = _verl_grad(verl, old, logp, adv)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-7)  # verl's 1e-8 in denominators
    torch.testing.assert_close(grad, their_grad, rtol=1e-7, atol=1e-12)


def test_cispo_matches_loop_twin_and_reports_clipping() -> None:
    loss, grad, stats = _ours("cispo", 1)
    logp, old, adv = _inputs(1)
    total, clipped, n = 0.0, 0, sum(LENGTHS)
    for b, length in enumerate(LENGTHS):
        for t in range(length):
            r = math.exp(float(logp[b, t] - old[b, t]))
            c = min(max(r, 1 - LOW), 1 + HIGH)
            clipped += c != r
            total += -c * float(adv[b, t]) * float(logp[b, t])
            # d/dlogp of -sg(c) A logp = -c A, over n tokens
            assert grad[b, t].item() == pytest.approx(-c * float(adv[b, t]) / n, rel=1e-10)
    assert loss.item() == pytest.approx(total / n, rel=1e-10)
    assert stats.clipfrac.item() == pytest.approx(clipped / n, rel=1e-6)  # type: ignore[attr-defined]


def test_sapo_matches_loop_twin() -> None:
    loss, _, _ = _ours("sapo", 2, "seq-mean-token-mean", tau_pos=1.0, tau_neg=1.05)
    logp, old, adv = _inputs(2)
    seqs = []
    for b, length in enumerate(LENGTHS):
        terms = []
        for t in range(length):
            r = math.exp(float(logp[b, t] - old[b, t]))
            a = float(adv[b, t])
            tau = 1.0 if a > 0 else 1.05
            terms.append(-a * (4.0 / tau) / (1.0 + math.exp(-tau * (r - 1.0))))
        seqs.append(sum(terms) / length)
    assert loss.item() == pytest.approx(sum(seqs) / len(seqs), rel=1e-10)


def test_geo_mean_matches_loop_twin_and_splits_over_micro_batches() -> None:
    loss, _, _ = _ours("geo_mean", 3)
    logp, old, adv = _inputs(3)
    seqs = []
    for b, length in enumerate(LENGTHS):
        logs, advs = [], []
        for t in range(length):
            lr = float(logp[b, t] - old[b, t])
            a = float(adv[b, t])
            bounded = min(max(lr, -LOW), HIGH)
            s = math.copysign(1.0, a) if a != 0 else 0.0
            logs.append(s * min(s * lr, s * bounded))
            advs.append(a)
        seqs.append(-sum(advs) / length * math.exp(sum(logs) / length))
    assert loss.item() == pytest.approx(sum(seqs) / 3, rel=1e-7)
    kw = {
        "clip_ratio_low": LOW,
        "clip_ratio_high": HIGH,
        "clip_ratio_c": 3.0,
        "agg_mode": "token-mean",
    }
    parts = sum(
        policy_loss(logp[r], old[r], adv[r], MASK[r], loss_mode="geo_mean", num_seqs=3.0, **kw)[
            0
        ].item()  # type: ignore[arg-type]
        for r in (slice(0, 1), slice(1, 3))
    )
    assert parts == pytest.approx(loss.item(), rel=1e-12)


def _verl_clip_cov(
    old: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cov: CovSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """compute_policy_loss_clip_cov (token-mean), transcribed; its random permutation picks
    every candidate when clip_num >= their number (the case tested)."""
    negative_approx_kl = logp - old
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    corr = torch.ones_like(adv)
    pg_losses2 = -adv * torch.clamp(ratio, 1 - LOW, 1 + HIGH)
    clip_by_origin = (pg_losses2 > pg_losses1) & (mask > 0)
    cov_all = (adv - _verl_masked_mean(adv, mask)) * (logp - _verl_masked_mean(logp.detach(), mask))
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(cov.clip_cov_ratio * mask.sum().item()), 1)
    top_k_idx = (cov_all < cov.clip_cov_ub) & (cov_all > cov.clip_cov_lb) & (mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    assert clip_num >= len(top_k_idx)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    return _verl_token_mean(pg_losses, mask), _verl_masked_mean((corr == 0).float(), mask)


def _verl_kl_cov(
    old: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cov: CovSettings
) -> torch.Tensor:
    """compute_policy_loss_kl_cov (token-mean), transcribed."""
    negative_approx_kl = logp - old
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    pg_losses_kl = -adv * ratio + cov.ppo_kl_coef * abs_kl
    pg_losses = pg_losses1.clone()
    all_valid = mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = adv[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = logp[all_valid].detach().reshape(-1).cpu()
    cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    k_percent_nums = max(1, int(len(cov_lst_all) * cov.kl_cov_ratio))
    large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
    large_cov_idxs = all_valid_idx[large_cov_idxs]
    rows, cols = large_cov_idxs // adv.shape[1], large_cov_idxs % adv.shape[1]
    pg_losses[rows, cols] = pg_losses_kl[rows, cols]
    return _verl_token_mean(pg_losses, mask)


def _cov_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp, old, adv = _inputs(5)
    return logp * 2.0, old * 2.0, adv * 3.0  # covariances reach the [lb, ub] band


def test_clip_cov_matches_verl_when_every_candidate_is_drawn() -> None:
    logp, old, adv = _cov_inputs()
    cov = CovSettings(clip_cov_ratio=1.0, clip_cov_lb=0.2, clip_cov_ub=5.0)
    ours, stats = policy_loss(
        logp,
        old,
        adv,
        MASK,
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
        clip_ratio_c=None,
        agg_mode="token-mean",
        loss_mode="clip_cov",
        cov=cov,
    )
    theirs, frac = _verl_clip_cov(old, logp, adv, FMASK, cov)
    assert 0 < frac.item() < 1  # the band holds some tokens, not all
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-7)
    assert stats.clipfrac.item() == pytest.approx(frac.item(), rel=1e-6)


def test_clip_cov_draws_the_share_it_is_asked_for_reproducibly() -> None:
    logp, old, adv = _cov_inputs()
    cov = CovSettings(clip_cov_ratio=1 / 9, clip_cov_lb=0.2, clip_cov_ub=5.0)  # 1 of 9 tokens
    kw = {"clip_ratio_low": LOW, "clip_ratio_high": HIGH, "clip_ratio_c": None}

    def run(seed: int) -> tuple[float, float]:
        g = torch.Generator().manual_seed(seed)
        loss, stats = policy_loss(
            logp,
            old,
            adv,
            MASK,
            agg_mode="token-mean",
            loss_mode="clip_cov",
            cov=cov,
            generator=g,
            **kw,  # type: ignore[arg-type]
        )
        return loss.item(), stats.clipfrac.item()

    assert run(0) == run(0)
    assert run(0)[1] == pytest.approx(1 / 9)


def test_kl_cov_matches_verl() -> None:
    logp, old, adv = _cov_inputs()
    cov = CovSettings(kl_cov_ratio=0.25, ppo_kl_coef=0.5)  # 2 of 9 tokens penalised
    ours, stats = policy_loss(
        logp,
        old,
        adv,
        MASK,
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
        clip_ratio_c=None,
        agg_mode="token-mean",
        loss_mode="kl_cov",
        cov=cov,
    )
    theirs = _verl_kl_cov(old, logp, adv, FMASK, cov)
    plain = _verl_token_mean(-adv * torch.exp(logp - old), FMASK)
    assert ours.item() != pytest.approx(plain.item())  # the penalty is on
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-10)
    assert stats.ppo_kl.item() == pytest.approx(float((logp - old).abs()[MASK].mean()), rel=1e-10)


@pytest.mark.parametrize("mode", ["cispo", "gpg", "sapo", "geo_mean", "clip_cov", "kl_cov"])
def test_each_loss_trains_a_step(mode: str) -> None:
    trainer = Trainer(TrainerConfig(policy_loss=PolicyLossConfig(loss_mode=mode)), tiny_llama())
    metrics = trainer.train_step(make_batch(0, [3, 4, 2]))
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
