"""Losses against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from patrl.trainer import aggregate, kl_penalty, masked_mean, policy_loss

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])


def test_aggregate_token_mean() -> None:
    assert aggregate(VALUES, MASK, "token-mean").item() == pytest.approx(7 / 3)


def test_aggregate_seq_mean_token_mean_skips_empty_sequences() -> None:
    # ((1 + 2) / 2 + 4 / 1) / 2 sequences with a loss token
    assert aggregate(VALUES, MASK, "seq-mean-token-mean").item() == pytest.approx(2.75)


def test_aggregate_seq_mean_token_sum() -> None:
    assert aggregate(VALUES, MASK, "seq-mean-token-sum").item() == pytest.approx(3.5)


def test_aggregate_global_denominators() -> None:
    assert aggregate(VALUES, MASK, "token-mean", num_tokens=7.0).item() == pytest.approx(1.0)
    got = aggregate(VALUES, MASK, "seq-mean-token-sum", num_seqs=7.0).item()
    assert got == pytest.approx(1.0)


def test_aggregate_ignores_nan_in_masked_positions() -> None:
    values = VALUES.clone()
    values[0, 2] = float("nan")
    values[2, :] = float("inf")
    assert aggregate(values, MASK, "token-mean").item() == pytest.approx(7 / 3)
    assert masked_mean(values, MASK).item() == pytest.approx(7 / 3)


def test_aggregate_unknown_mode_names_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"'seq-mean'.*token-mean"):
        aggregate(VALUES, MASK, "seq-mean")


# ratio = exp(logp - old) per token; advantages chosen to hit each branch once:
#  t0 r=0.5 A=+1 unclipped -> -0.5      t1 r=0.5 A=-1 clipped low -> 0.8
#  t2 r=1.5 A=+1 clipped high -> -1.28  t3 r=5.0 A=-1 dual clip -> 3.0 (else 5.0)
#  t4 r=1.0 A=+2 unclipped -> -2.0
RATIOS = torch.tensor([[0.5, 0.5, 1.5, 5.0, 1.0]])
ADV = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]])
OLD = torch.full((1, 5), -2.0)
ALL = torch.ones(1, 5, dtype=torch.bool)
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "agg_mode": "token-mean"}


def _logp() -> torch.Tensor:
    return (OLD + RATIOS.log()).requires_grad_(True)


def test_policy_loss_branches_and_stats() -> None:
    logp = _logp()
    loss, stats = policy_loss(logp, OLD, ADV, ALL, clip_ratio_c=3.0, **CLIP)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx((-0.5 + 0.8 - 1.28 + 3.0 - 2.0) / 5, abs=1e-6)
    assert stats.clipfrac.item() == pytest.approx(2 / 5)
    assert stats.clipfrac_low.item() == pytest.approx(1 / 5)
    assert stats.clipfrac_high.item() == pytest.approx(1 / 5)
    assert stats.clipfrac_lower.item() == pytest.approx(1 / 5)
    expected_kl = -(2 * math.log(0.5) + math.log(1.5) + math.log(5.0)) / 5
    assert stats.ppo_kl.item() == pytest.approx(expected_kl, abs=1e-6)
    loss.backward()
    # Only unclipped tokens carry gradient: d(-A r)/d logp = -A r, over 5 tokens.
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.1, 0.0, 0.0, 0.0, -0.4]]))


def test_policy_loss_without_dual_clip() -> None:
    loss, stats = policy_loss(_logp(), OLD, ADV, ALL, clip_ratio_c=None, **CLIP)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx((-0.5 + 0.8 - 1.28 + 5.0 - 2.0) / 5, abs=1e-6)
    assert stats.clipfrac_lower.item() == 0.0


def test_policy_loss_masked_tokens_do_not_count() -> None:
    mask = torch.tensor([[True, False, False, False, True]])
    loss, stats = policy_loss(_logp(), OLD, ADV, mask, clip_ratio_c=3.0, **CLIP)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx((-0.5 - 2.0) / 2, abs=1e-6)
    assert stats.clipfrac.item() == 0.0


def test_policy_loss_on_policy_is_minus_mean_advantage() -> None:
    logp = OLD.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, OLD, ADV, ALL, clip_ratio_c=3.0, **CLIP)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx(-ADV.mean().item())
    assert stats.clipfrac.item() == 0.0 and stats.ppo_kl.item() == 0.0


def test_decoupled_ppo_behaviour_weight_and_cap() -> None:
    # proximal == current (ratio 1), behaviour weights exp(old - behav) = 1, 2, 4; cap 3.
    old = torch.zeros(1, 3)
    behav = -torch.tensor([[0.0, math.log(2.0), math.log(4.0)]])
    adv = torch.ones(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    loss, stats = policy_loss(
        old.clone(),
        old,
        adv,
        mask,
        agg_mode="token-mean",
        behaviour_logprobs=behav,
        behaviour_weight_cap=3.0,
        **kw,  # type: ignore[arg-type]
    )
    # Capped token contributes 0 but still counts in the denominator: (-1 - 2 + 0) / 3.
    assert loss.item() == pytest.approx(-1.0)
    assert stats.behav_capped.item() == pytest.approx(1 / 3)
    assert stats.behav_weight.item() == pytest.approx(1.5)
    uncapped, _ = policy_loss(
        old.clone(),
        old,
        adv,
        mask,
        agg_mode="token-mean",
        behaviour_logprobs=behav,
        **kw,  # type: ignore[arg-type]
    )
    assert uncapped.item() == pytest.approx(-7 / 3)


def test_policy_loss_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"clip_ratio_c must be > 1\.0"):
        policy_loss(_logp(), OLD, ADV, ALL, clip_ratio_c=0.5, **CLIP)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs behaviour_logprobs"):
        policy_loss(
            _logp(),
            OLD,
            ADV,
            ALL,
            clip_ratio_c=3.0,
            behaviour_weight_cap=2.0,
            **CLIP,  # type: ignore[arg-type]
        )


LOGP = torch.tensor([math.log(0.5)])
REF = torch.tensor([math.log(0.25)])


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", math.log(2.0)),
        ("kl", math.log(2.0)),
        ("k2", 0.5 * math.log(2.0) ** 2),
        ("mse", 0.5 * math.log(2.0) ** 2),
        ("k3", 0.5 + math.log(2.0) - 1.0),  # r = ref/pi = 1/2: r - log r - 1
        ("low_var_kl", 0.5 + math.log(2.0) - 1.0),
    ],
)
def test_kl_penalty_estimators(kind: str, expected: float) -> None:
    assert kl_penalty(LOGP, REF, kind).item() == pytest.approx(expected, abs=1e-6)


def test_kl_penalty_is_zero_for_identical_policies() -> None:
    logp = torch.randn(4, 7)
    for kind in ("k1", "k2", "k3"):
        assert torch.count_nonzero(kl_penalty(logp, logp.clone(), kind)) == 0


def test_kl_penalty_unknown_type() -> None:
    with pytest.raises(ValueError, match=r"'k4'.*low_var_kl"):
        kl_penalty(LOGP, REF, "k4")
