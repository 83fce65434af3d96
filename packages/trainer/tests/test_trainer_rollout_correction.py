"""Rollout correction (TIS, rejection, bypass) against plain Python loops and against verl's
functions transcribed from verl/trainer/ppo/rollout_corr_helper.py and core_algos.py (commit
b178a3c) on the same padded inputs; and the trainer's bypass step against its formula."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from trainer_testkit import make_batch, tiny_llama

from patrl.trainer import PolicyBatch, Trainer, TrainerConfig, policy_loss
from patrl.trainer.config import PolicyLossConfig, RolloutCorrectionConfig
from patrl.trainer.losses import reinforce_loss
from patrl.trainer.rollout_correction import (
    correction,
    is_weights,
    offpolicy_metrics,
    parse_rs,
    rejection_mask,
)

# Four responses padded to 6 tokens: lengths 6, 3, 1 and 0 (a row of padding only).
LENGTHS = (6, 3, 1, 0)
MASK = torch.tensor([[t < n for t in range(6)] for n in LENGTHS])
FMASK = MASK.double()


def _logps(seed: int, spread: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    train = rollout + spread * torch.randn(4, 6, generator=g, dtype=torch.float64)
    return train, rollout


# ---- verl, transcribed ---------------------------------------------------------------------


def _verl_masked_sum(
    values: torch.Tensor, mask: torch.Tensor, axis: int | None = None
) -> torch.Tensor:
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum(axis=axis) if axis is not None else (valid * mask).sum()


def _verl_masked_mean(
    values: torch.Tensor, mask: torch.Tensor, axis: int | None = None
) -> torch.Tensor:
    s = _verl_masked_sum(values, mask, axis)
    return s / ((mask.sum(axis=axis) if axis is not None else mask.sum()) + 1e-8)


def _verl_is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    threshold: float,
    normalize: bool,
) -> torch.Tensor:
    """compute_rollout_correction_weights (weights only)."""
    if rollout_is == "token":
        w = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:
        s = _verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        w = torch.exp(torch.clamp(s, min=-20.0, max=20.0)).expand_as(log_ratio)
    w = w * response_mask
    w = w.clamp(max=threshold).detach()
    if normalize:
        if rollout_is == "token":
            mean = _verl_masked_mean(w, response_mask)
        else:
            seq_w = _verl_masked_mean(w, response_mask, axis=-1)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(dtype=w.dtype)
            mean = (seq_w * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
    return w


def _verl_rs(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    option: str,
    lower: float | None,
    upper: float,
) -> tuple[torch.Tensor, float, float]:
    """compute_rollout_rejection_mask for one option: the modified mask and the option's token
    and sequence masked fractions."""
    lr = torch.clamp(log_ratio, min=-20.0, max=20.0)
    k = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}[option[-2:]]
    if option.startswith("token"):
        stat = k
    elif option.startswith("seq_sum"):
        stat = _verl_masked_sum(k, response_mask, axis=-1).unsqueeze(-1)
    elif option.startswith("seq_mean"):
        stat = _verl_masked_mean(k, response_mask, axis=-1).unsqueeze(-1)
    else:
        vals = k.masked_fill(~response_mask.bool(), float("-inf")).max(dim=-1).values
        stat = torch.where(vals == float("-inf"), torch.zeros_like(vals), vals).unsqueeze(-1)
    if option.endswith("k1"):
        assert lower is not None
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    else:
        keep = stat <= upper
    keep = keep.expand_as(response_mask.bool())
    keep_f = keep.to(log_ratio.dtype)
    token_frac = _verl_masked_mean(1 - keep_f, response_mask).item()
    seq_valid = (response_mask.sum(dim=-1) > 0).float()
    seq_keep = (~((~keep) & response_mask.bool())).all(dim=-1).float()
    seq_frac = (((1.0 - seq_keep) * seq_valid).sum() / seq_valid.sum()).item()
    return (response_mask * keep_f), token_frac, seq_frac


def _verl_offpolicy(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """compute_offpolicy_metrics."""
    m = {}
    mean_train = _verl_masked_mean(old, mask, axis=-1)
    m["training_ppl"] = torch.exp(-mean_train).mean().item()
    m["kl"] = _verl_masked_mean(rollout - old, mask).item()
    log_ratio = old - rollout
    m["k3_kl"] = _verl_masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item()
    mean_rollout = _verl_masked_mean(rollout, mask, axis=-1)
    m["rollout_ppl"] = torch.exp(-mean_rollout).mean().item()
    diff = mean_rollout - mean_train
    m["log_ppl_diff"] = diff.mean().item()
    m["log_ppl_abs_diff"] = diff.abs().mean().item()
    m["ppl_ratio"] = torch.exp(diff).mean().item()
    rho = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    m["chi2_token"] = (_verl_masked_mean(rho.square(), mask) - 1.0).item()
    s = torch.clamp(_verl_masked_sum(log_ratio, mask, axis=-1), min=-20.0, max=20.0)
    m["chi2_seq"] = (torch.exp(2.0 * s).mean() - 1.0).item()
    return m


def _verl_vanilla(
    old: torch.Tensor,
    logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    w: torch.Tensor | None,
) -> torch.Tensor:
    """compute_policy_loss_vanilla (clip 0.2, clip_ratio_c 3, token-mean) with IS weights."""
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 0.8, 1.2)
    c1 = torch.maximum(l1, l2)
    c2 = torch.min(-adv * 3.0, c1)
    pg = torch.where(adv < 0, c2, c1)
    if w is not None:
        pg = pg * w
    return _verl_masked_sum(pg, mask) / mask.sum()


def _verl_reinforce(
    logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, w: torch.Tensor | None
) -> torch.Tensor:
    """compute_policy_loss_reinforce, token-mean."""
    pg = -adv * logp * w if w is not None else -adv * logp
    return _verl_masked_sum(pg, mask) / mask.sum()


# ---- IS weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_match_verl(level: str, normalize: bool) -> None:
    train, rollout = _logps(0)
    ours, _ = is_weights(train - rollout, MASK, level, 1.5, normalize)
    theirs = _verl_is_weights(train - rollout, FMASK, level, 1.5, normalize)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)


def test_is_weights_match_loop_twin_and_are_bounded_and_zero_at_padding() -> None:
    train, rollout = _logps(1, spread=1.0)
    threshold = 2.0
    tok, _ = is_weights(train - rollout, MASK, "token", threshold)
    seq, _ = is_weights(train - rollout, MASK, "sequence", threshold)
    for b, n in enumerate(LENGTHS):
        total = sum(float(train[b, t] - rollout[b, t]) for t in range(n))
        for t in range(6):
            if t >= n:
                assert tok[b, t].item() == 0.0 and seq[b, t].item() == 0.0
                continue
            want = min(math.exp(float(train[b, t] - rollout[b, t])), threshold)
            assert tok[b, t].item() == pytest.approx(want, rel=1e-12)
            assert seq[b, t].item() == pytest.approx(min(math.exp(total), threshold), rel=1e-12)
    assert float(tok.max()) <= threshold and float(seq.max()) <= threshold
    assert float(tok.max()) == threshold  # spread 1.0: some weights are truncated


def test_is_metrics_fractions_before_truncation() -> None:
    train, rollout = _logps(2, spread=1.0)
    _, m = is_weights(train - rollout, MASK, "token", 2.0)
    lr = (train - rollout)[MASK]
    assert m["rollout_is_ratio_fraction_high"].item() == pytest.approx(
        float((lr.exp() > 2.0).double().mean()), rel=1e-6
    )
    assert m["rollout_is_ratio_fraction_low"].item() == pytest.approx(
        float((lr.exp() < 0.5).double().mean()), rel=1e-6
    )


# ---- rejection -----------------------------------------------------------------------------

RS_CASES = [
    ("token_k1", "0.7_1.4"),
    ("token_k2", 0.05),
    ("token_k3", 0.05),
    ("seq_sum_k1", "0.5_2.0"),
    ("seq_sum_k2", 0.2),
    ("seq_sum_k3", 0.2),
    ("seq_mean_k1", 1.3),  # one upper bound: lower 1/1.3
    ("seq_mean_k2", 0.05),
    ("seq_mean_k3", 0.05),
    ("seq_max_k2", 0.1),
    ("seq_max_k3", 0.1),
]


@pytest.mark.parametrize(("option", "threshold"), RS_CASES)
def test_rejection_matches_verl(option: str, threshold: str | float) -> None:
    train, rollout = _logps(3, spread=0.4)
    (opt,) = parse_rs(option, threshold)
    kept, m = rejection_mask(train - rollout, MASK, [opt])
    mask_v, token_frac, seq_frac = _verl_rs(train - rollout, FMASK, option, opt.lower, opt.upper)
    assert torch.equal(kept, mask_v.bool())
    assert m[f"rollout_rs_{option}_masked_fraction"].item() == pytest.approx(token_frac, rel=1e-12)
    # verl computes the sequence fraction in fp32
    assert m[f"rollout_rs_{option}_seq_masked_fraction"].item() == pytest.approx(seq_frac, rel=1e-6)


@pytest.mark.parametrize(("option", "threshold"), RS_CASES)
def test_rejection_matches_loop_twin(option: str, threshold: str | float) -> None:
    train, rollout = _logps(4, spread=0.4)
    (opt,) = parse_rs(option, threshold)
    kept, m = rejection_mask(train - rollout, MASK, [opt])
    kind = option[-2:]

    def div(x: float) -> float:
        return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1.0 - x}[kind]

    def ok(v: float) -> bool:
        if opt.lower is not None:
            return math.log(opt.lower) <= v <= math.log(opt.upper)
        return v <= opt.upper

    rejected = 0
    for b, n in enumerate(LENGTHS):
        ds = [div(float(train[b, t] - rollout[b, t])) for t in range(n)]
        if option.startswith("token"):
            keeps = [ok(d) for d in ds]
        else:
            agg = {"sum": sum, "mean": lambda d: sum(d) / len(d), "max": max}[option.split("_")[1]]
            keeps = [ok(agg(ds))] * n if n else []
        rejected += keeps.count(False)
        assert kept[b].tolist() == keeps + [False] * (6 - n)
    total = sum(LENGTHS)
    assert m["rollout_rs_masked_fraction"].item() == pytest.approx(rejected / total, rel=1e-6)


def test_rejection_options_combine_with_and() -> None:
    train, rollout = _logps(5, spread=0.4)
    opts = parse_rs("token_k2,seq_mean_k3", "0.05,0.05")
    kept, _ = rejection_mask(train - rollout, MASK, opts)
    a, _ = rejection_mask(train - rollout, MASK, [opts[0]])
    b, _ = rejection_mask(train - rollout, MASK, [opts[1]])
    assert torch.equal(kept, a & b)


@pytest.mark.parametrize(
    ("rs", "threshold", "message"),
    [
        ("seq_max_k1", 2.0, "unknown"),
        ("token_k2", None, "needs rollout_rs_threshold"),
        ("token_k2", "0.1_0.2", "one upper bound"),
        ("token_k1,token_k2", "1,2,3", "one per option"),
        ("token_k3", -1.0, "positive"),
    ],
)
def test_bad_rejection_settings_are_named(rs: str, threshold: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_rs(rs, threshold)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=message):
        RolloutCorrectionConfig(rollout_rs=rs, rollout_rs_threshold=threshold)  # type: ignore[arg-type]


# ---- off-policy metrics --------------------------------------------------------------------


def test_offpolicy_metrics_match_verl_and_loop() -> None:
    train, rollout = _logps(6)
    rows = slice(0, 3)  # verl's per-sequence means need no empty row
    ours = offpolicy_metrics(train[rows], rollout[rows], MASK[rows])
    theirs = _verl_offpolicy(train[rows], rollout[rows], FMASK[rows])
    for key, value in theirs.items():
        assert ours[key].item() == pytest.approx(value, rel=1e-10), key
    diffs = [float(rollout[b, t] - train[b, t]) for b, n in enumerate(LENGTHS) for t in range(n)]
    # verl's masked mean adds 1e-8 to the token count (10 here): 1e-9 relative
    assert ours["kl"].item() == pytest.approx(sum(diffs) / len(diffs), rel=1e-8)


def test_correction_prefixes_verl_names_and_applies_both() -> None:
    train, rollout = _logps(7, spread=0.4)
    w, kept, m = correction(
        train,
        rollout,
        MASK,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k3",
        rollout_rs_threshold=0.05,
    )
    assert w is not None and torch.equal(w, is_weights(train - rollout, MASK, "token", 2.0)[0])
    assert torch.equal(kept, rejection_mask(train - rollout, MASK, parse_rs("token_k3", 0.05))[0])
    for key in ("kl", "k3_kl", "rollout_is_mean", "rollout_rs_masked_fraction", "chi2_seq"):
        assert f"rollout_corr/{key}" in m


# ---- the losses ----------------------------------------------------------------------------


def test_is_weighted_vanilla_loss_matches_verl() -> None:
    train, rollout = _logps(8, spread=0.3)
    g = torch.Generator().manual_seed(8)
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    logp = train + 0.1 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    w, _ = is_weights(train - rollout, MASK, "token", 2.0)
    ours, _ = policy_loss(
        logp,
        train,
        adv,
        MASK,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_ratio_c=3.0,
        agg_mode="token-mean",
        is_weights=w,
    )
    theirs = _verl_vanilla(train, logp, adv, FMASK, w)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)


def test_reinforce_loss_matches_verl_and_its_gradient_is_weighted() -> None:
    train, rollout = _logps(9, spread=0.3)
    adv = torch.randn(4, 6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    w, _ = is_weights(train - rollout, MASK, "sequence", 2.0)
    logp = train.clone().requires_grad_(True)
    ours, stats = reinforce_loss(logp, rollout, adv, MASK, agg_mode="token-mean", is_weights=w)
    theirs = _verl_reinforce(train, adv, FMASK, w)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    ours.backward()
    assert logp.grad is not None
    n = sum(LENGTHS)
    torch.testing.assert_close(logp.grad, torch.where(MASK, -adv * w / n, 0.0), rtol=1e-12, atol=0)
    assert stats.ppo_kl.item() == pytest.approx(float((rollout - train)[MASK].mean()), rel=1e-10)


def _bypass_trainer(rc: RolloutCorrectionConfig) -> Trainer:
    cfg = TrainerConfig(policy_loss=PolicyLossConfig(rollout_correction=rc), clip_ratio_c=3.0)
    return Trainer(cfg, tiny_llama())


def _scores(trainer: Trainer, batch: PolicyBatch) -> list[torch.Tensor]:
    return trainer.compute_logprobs(batch)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_step_loss_follows_the_formula(loss_type: str) -> None:
    """Bypass mode: old = the rollout's logprobs (here the trainer's own minus 0.5 on every
    response token: ratio e^0.5, token IS weights e^0.5 truncated at 1.5); the step's pg_loss
    is the formula on those inputs, and the mismatch metrics say so."""
    rc = RolloutCorrectionConfig(
        bypass_mode=True, loss_type=loss_type, rollout_is="token", rollout_is_threshold=1.5
    )
    trainer = _bypass_trainer(rc)
    batch = make_batch(0, [3, 5, 2])
    current = _scores(trainer, batch)
    batch.old_logprobs = [
        torch.where(m, lp - 0.5, torch.zeros_like(lp))
        for lp, m in zip(current, batch.loss_mask, strict=True)
    ]
    metrics = trainer.train_step(batch)
    adv = torch.cat([a[m] for a, m in zip(batch.advantages, batch.loss_mask, strict=True)]).double()
    lp = torch.cat([c[m] for c, m in zip(current, batch.loss_mask, strict=True)]).double()
    if loss_type == "ppo_clip":  # ratio e^0.5 > 1.2: clipped where A > 0, unclipped where A < 0
        ratio = math.exp(0.5)
        want = torch.where(adv > 0, -adv * 1.2, -adv * ratio).mean().item()
    else:
        want = (-adv * lp * 1.5).mean().item()
    assert metrics["actor/pg_loss"] == pytest.approx(want, rel=1e-4)
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.5, abs=1e-5)
    # verl's rollout_is_mean is taken before the truncation
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(math.exp(0.5), rel=1e-5)


def test_bypass_rejection_drops_tokens_from_the_loss() -> None:
    rc = RolloutCorrectionConfig(
        bypass_mode=True, loss_type="reinforce", rollout_rs="token_k1", rollout_rs_threshold=1.5
    )
    trainer = _bypass_trainer(rc)
    batch = make_batch(1, [4, 4])
    current = _scores(trainer, batch)
    # sample 0 off by 1.0 per token (ratio e > 1.5: rejected), sample 1 exact (kept)
    shift = [1.0, 0.0]
    batch.old_logprobs = [
        torch.where(m, lp - d, torch.zeros_like(lp))
        for lp, m, d in zip(current, batch.loss_mask, shift, strict=True)
    ]
    metrics = trainer.train_step(batch)
    m1 = batch.loss_mask[1]
    # kept tokens over the step's 8 tokens (rejected ones stay in the denominator)
    want = float((-batch.advantages[1][m1].double() * current[1][m1].double()).sum() / 8)
    assert metrics["actor/pg_loss"] == pytest.approx(want, rel=1e-4)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)


def test_bypass_needs_the_rollout_logprobs() -> None:
    trainer = _bypass_trainer(RolloutCorrectionConfig(bypass_mode=True))
    with pytest.raises(ValueError, match="bypass_mode needs the rollout's logprobs"):
        trainer.train_step(make_batch(2, [3]))


def test_decoupled_weights_in_the_batch_scale_the_loss() -> None:
    """Weights of 2 on every token double the on-policy loss (ratio 1), entropy/KL untouched."""
    trainer = Trainer(TrainerConfig(), tiny_llama())
    plain = make_batch(3, [3, 4])
    weighted = make_batch(3, [3, 4])
    weighted.rollout_is_weights = [torch.where(m, 2.0, 0.0) for m in weighted.loss_mask]
    base = Trainer(TrainerConfig(), tiny_llama()).train_step(plain)["actor/pg_loss"]
    assert trainer.train_step(weighted)["actor/pg_loss"] == pytest.approx(2 * base, rel=1e-5)


# ---- verl's GSPO metric --------------------------------------------------------------------


def test_gspo_ppo_kl_is_unclamped_as_verls() -> None:
    """verl's compute_policy_loss_gspo reports masked_mean(-(log_prob - old_log_prob)) with no
    clamp; the vanilla loss clamps its log-ratio at +-20 first (verl's too)."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[-30.0, 0.5, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.ones(1, 3, dtype=torch.float64)
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    _, gspo = policy_loss(
        logp, old, adv, mask, agg_mode="seq-mean-token-mean", loss_mode="gspo", **kw
    )  # type: ignore[arg-type]
    assert gspo.ppo_kl.item() == pytest.approx((30.0 - 0.5 + 1.0) / 3, rel=1e-12)
    _, vanilla = policy_loss(logp, old, adv, mask, agg_mode="token-mean", **kw)  # type: ignore[arg-type]
    assert vanilla.ppo_kl.item() == pytest.approx((20.0 - 0.5 + 1.0) / 3, rel=1e-12)


def test_ragged_offpolicy_metrics_equal_the_padded_ones() -> None:
    from patrl.trainer.rollout_correction import ragged_offpolicy_metrics

    train, rollout = _logps(10)
    rows = range(3)  # the non-empty rows
    padded = offpolicy_metrics(train[:3], rollout[:3], MASK[:3])
    ragged = ragged_offpolicy_metrics(
        [train[b, : LENGTHS[b]] for b in rows], [rollout[b, : LENGTHS[b]] for b in rows]
    )
    assert set(padded) == set(ragged)
    for key, value in padded.items():
        assert ragged[key].item() == pytest.approx(value.item(), rel=1e-12, abs=1e-15), key
    with pytest.raises(ValueError, match="same number of tokens"):
        ragged_offpolicy_metrics([train[0, :2]], [rollout[0, :3]])


@pytest.mark.parametrize(
    "rc",
    [
        None,  # decoupled: the batch carries the weights
        RolloutCorrectionConfig(
            bypass_mode=True, rollout_is="token", rollout_rs="token_k3", rollout_rs_threshold=0.02
        ),
        RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="token"),
    ],
)
def test_corrected_step_is_the_same_in_one_micro_batch_or_eight(
    rc: RolloutCorrectionConfig | None,
) -> None:
    """Token-level weights and rejection split exactly over micro-batches (the step's token
    counts are global), so one micro-batch of 8 samples and 8 of 1 give the same update."""
    from trainer_testkit import full_weights

    batch = make_batch(4, [6, 2, 9, 4, 4, 7, 1, 5], with_old=True)
    g = torch.Generator().manual_seed(4)
    if rc is None:
        batch.rollout_is_weights = [
            torch.where(m, 0.5 + 1.5 * torch.rand(m.shape, generator=g), 0.0)
            for m in batch.loss_mask
        ]

    def train(**kw: object) -> dict[str, torch.Tensor]:
        cfg = TrainerConfig(
            policy_loss=PolicyLossConfig(rollout_correction=rc),
            ppo_max_token_len_per_gpu=100 * 8 * max(batch.lengths),
            **kw,  # type: ignore[arg-type]
        )
        trainer = Trainer(cfg, tiny_llama())
        trainer.train_step(batch)
        return full_weights(trainer)

    one, eight = train(), train(ppo_micro_batch_size_per_gpu=1)
    for name in one:
        torch.testing.assert_close(one[name], eight[name], atol=1e-6, rtol=0, msg=name)
