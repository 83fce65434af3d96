"""Single-process Trainer behaviour: step-0 invariants, accumulation, skips, schedule, errors."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from pydantic import ValidationError
from trainer_testkit import config, full_weights, make_batch, tiny_llama, tiny_qwen2_tied

from patrl.trainer import NonFiniteError, OptimConfig, PolicyBatch, Trainer, TrainerConfig
from patrl.trainer.schedule import lr_factor


def test_step0_invariants_on_policy_with_reference() -> None:
    trainer = Trainer(config(use_kl_loss=True, kl_loss_type="low_var_kl"), tiny_llama())
    metrics = trainer.train_step(make_batch(0, [3, 7, 2, 9, 5]))
    assert metrics["actor/ppo_kl"] == 0.0  # ratio == 1 exactly
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/kl_loss"] == 0.0  # reference == policy before the first update
    assert metrics["actor/grad_norm"] > 0
    assert trainer.step == 1
    # After an update the reference differs from the policy: the same KL is now positive.
    assert trainer.train_step(make_batch(1, [4, 6]))["actor/kl_loss"] > 0


def test_given_old_logprobs_equal_to_current_give_ratio_one() -> None:
    trainer = Trainer(config(), tiny_llama())
    batch = make_batch(0, [3, 5, 8])
    scored = trainer.compute_logprobs(batch)
    batch.old_logprobs = scored
    metrics = trainer.train_step(batch)
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0


@pytest.mark.parametrize("budget", [10_000, 24])  # one micro-batch, several
def test_on_policy_step_needs_no_scoring_pass_and_equals_one_given_the_scores(
    budget: int,
) -> None:
    batch = make_batch(4, [3, 9, 1, 6, 4])
    fused = Trainer(config(ppo_max_token_len_per_gpu=budget), tiny_llama())
    separate = Trainer(config(ppo_max_token_len_per_gpu=budget), tiny_llama())
    before = separate.compute_logprobs(batch)  # the slow twin: a scoring pass first
    given = PolicyBatch(batch.input_ids, batch.loss_mask, batch.advantages, old_logprobs=before)
    calls = 0
    score = fused._score

    def counted(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        return score(*args, **kwargs)  # type: ignore[arg-type]

    fused._score = counted  # type: ignore[method-assign]
    m_fused, m_separate = fused.train_step(batch), separate.train_step(given)
    assert calls == 0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy"):
        assert m_fused[key] == pytest.approx(m_separate[key], rel=1e-6, abs=1e-9), key
    w_fused, w_separate = full_weights(fused), full_weights(separate)
    for name in w_fused:
        torch.testing.assert_close(w_fused[name], w_separate[name], atol=1e-7, rtol=0, msg=name)
    # What the on-policy step took its ratio against is the policy before the update.
    for got, want in zip(fused.scored_logprobs(), before, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="no on-policy logprobs"):
        separate.scored_logprobs()


def test_compute_logprobs_matches_plain_hf_forward() -> None:
    trainer = Trainer(config(temperature=0.7), tiny_llama())
    batch = make_batch(2, [3, 9, 1])
    got = trainer.compute_logprobs(batch)
    with torch.no_grad():
        for ids, logp in zip(batch.input_ids, got, strict=True):
            logits = trainer.model(input_ids=ids[None]).logits[0].float()
            ref = torch.log_softmax(logits / 0.7, -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
            assert logp[0] == 0.0
            torch.testing.assert_close(logp[1:], ref, atol=1e-5, rtol=1e-5)


def _train(budget: int, batch: PolicyBatch, steps: int = 1, **overrides: object) -> Trainer:
    trainer = Trainer(config(ppo_max_token_len_per_gpu=budget, **overrides), tiny_llama())
    for _ in range(steps):
        trainer.train_step(batch)
    return trainer


@pytest.mark.parametrize(
    ("mode", "loss_mode"),
    [
        ("token-mean", "vanilla"),
        ("seq-mean-token-mean", "vanilla"),
        ("seq-mean-token-sum", "vanilla"),
        ("seq-mean-token-sum-norm", "vanilla"),
        ("seq-mean-token-mean", "gspo"),
    ],
)
def test_grad_accumulation_one_micro_batch_of_8_equals_8_of_1(mode: str, loss_mode: str) -> None:
    batch = make_batch(3, [6, 2, 9, 4, 4, 7, 1, 5], with_old=True)
    kw = {
        "loss_agg_mode": mode,
        "use_kl_loss": True,
        "entropy_coeff": 0.01,
        "policy_loss": {"loss_mode": loss_mode},
    }
    # A budget so large that one more micro-batch always costs more than any padding.
    budget = 100 * 8 * max(batch.lengths)
    one = _train(budget, batch, **kw)
    eight = _train(budget, batch, ppo_micro_batch_size_per_gpu=1, **kw)
    assert len(one._plan(batch)) == 1 and len(eight._plan(batch)) == 8
    w1, w8 = full_weights(one), full_weights(eight)
    for name in w1:
        torch.testing.assert_close(w1[name], w8[name], atol=1e-6, rtol=0, msg=name)
    # The comparison has teeth: one step moved the weights by far more than the tolerance.
    init = full_weights(Trainer(config(), tiny_llama()))
    assert max((w1[n] - init[n]).abs().max().item() for n in w1) > 1e-4


def test_entropy_bonus_enters_the_loss() -> None:
    trainer = Trainer(config(entropy_coeff=0.1), tiny_llama())
    m = trainer.train_step(make_batch(4, [5, 3]))
    assert m["actor/entropy"] > 0
    assert m["actor/loss"] == pytest.approx(m["actor/pg_loss"] - 0.1 * m["actor/entropy"], rel=1e-5)


def test_gradient_checkpointing_gives_the_same_update() -> None:
    batch = make_batch(5, [4, 8, 2])
    plain = full_weights(_train(64, batch))
    ckpt = full_weights(_train(64, batch, enable_gradient_checkpointing=True))
    for name in plain:
        torch.testing.assert_close(plain[name], ckpt[name], atol=1e-6, rtol=0)


def test_tied_embeddings_model_trains_and_exports_names_once() -> None:
    trainer = Trainer(config(), tiny_qwen2_tied())
    trainer.train_step(make_batch(6, [3, 4]))
    names = [n for b in trainer.iter_full_weights(1 << 20) for n, _ in b]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_nonfinite_step_is_skipped_then_stops_the_run(caplog: pytest.LogCaptureFixture) -> None:
    trainer = Trainer(config(max_nonfinite_steps=2), tiny_llama())
    good = make_batch(7, [4, 4])
    bad = make_batch(7, [4, 4])
    bad.advantages[0][-1] = float("nan")
    trainer.train_step(good)
    before = full_weights(trainer)
    with caplog.at_level(logging.WARNING, logger="patrl.trainer.trainer"):
        metrics = trainer.train_step(bad)
    assert "skipped a step with a non-finite loss" in caplog.text
    assert metrics["actor/nonfinite_skipped"] == 1.0 and trainer.step == 1
    after = full_weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)
    trainer.train_step(good)  # a good step resets the run of bad ones
    assert trainer.nonfinite_in_a_row == 0 and trainer.nonfinite_total == 1
    trainer.train_step(bad)
    with pytest.raises(NonFiniteError, match=r"2 steps in a row.*max_nonfinite_steps=2"):
        trainer.train_step(bad)


def test_lr_warmup_then_cosine() -> None:
    cfg = OptimConfig(
        lr=1.0,
        lr_warmup_steps=4,
        lr_scheduler_type="cosine",
        total_training_steps=12,
        min_lr_ratio=0.1,
    )
    assert [lr_factor(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(8, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lr_factor(12, cfg) == pytest.approx(0.1)
    assert lr_factor(50, cfg) == pytest.approx(0.1)
    const = OptimConfig(lr=1.0, lr_warmup_steps=2)
    assert [lr_factor(s, const) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_lr_warmup_steps_minus_one_takes_the_ratio_of_the_horizon() -> None:
    """verl's rule: lr_warmup_steps=-1 (the default) warms up for int(ratio x total) steps."""
    cfg = OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.25, total_training_steps=10)
    assert cfg.lr_warmup_steps == -1 and cfg.num_warmup_steps == 2
    assert [lr_factor(s, cfg) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert OptimConfig().num_warmup_steps == 0  # ratio 0: no warmup, no horizon needed
    explicit = OptimConfig(lr_warmup_steps=3, lr_warmup_steps_ratio=0.5, total_training_steps=10)
    assert explicit.num_warmup_steps == 3  # an explicit count wins over the ratio


def test_trainer_reports_scheduled_lr() -> None:
    trainer = Trainer(config(optim={"lr": 1e-3, "eps": 1e-6, "lr_warmup_steps": 2}), tiny_llama())
    lrs = [trainer.train_step(make_batch(8, [3]))["actor/lr"] for _ in range(3)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3])


def test_decoupled_ppo_caps_behaviour_weight() -> None:
    trainer = Trainer(config(behav_imp_weight_cap=2.0), tiny_llama())
    batch = make_batch(9, [6, 6])
    batch.old_logprobs = trainer.compute_logprobs(batch)
    # Behaviour weight exp(old - behaviour): e^3 > cap on sample 0, e^0.5 < cap on sample 1.
    batch.behaviour_logprobs = [batch.old_logprobs[0] - 3.0, batch.old_logprobs[1] - 0.5]
    metrics = trainer.train_step(batch)
    assert metrics["actor/behav_capped_frac"] == pytest.approx(0.5)
    assert metrics["actor/behav_imp_weight"] == pytest.approx(math.exp(0.5), rel=1e-5)


def test_metric_names_are_verl_names() -> None:
    m = Trainer(config(), tiny_llama()).train_step(make_batch(10, [2, 9, 3]))
    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "perf/throughput",
        "perf/tokens_per_s",
        "perf/padded_fraction",
        "perf/time_per_step",
    ):
        assert key in m and math.isfinite(m[key]), key


# ---- bad input ----------------------------------------------------------------------------


def test_sample_longer_than_budget_is_rejected() -> None:
    trainer = Trainer(config(ppo_max_token_len_per_gpu=8), tiny_llama())
    with pytest.raises(ValueError, match=r"sample 1 has 14 tokens.*ppo_max_token_len_per_gpu=8"):
        trainer.train_step(make_batch(0, [2, 10]))


def test_mismatched_lengths_are_rejected() -> None:
    ids = [torch.arange(5)]
    mask = [torch.tensor([False, False, True, True, True])]
    with pytest.raises(ValueError, match=r"advantages\[0\] has shape \(4,\).*\(5,\)"):
        PolicyBatch(ids, mask, [torch.zeros(4)])
    with pytest.raises(ValueError, match="old_logprobs has 2 samples, input_ids has 1"):
        PolicyBatch(ids, mask, [torch.zeros(5)], old_logprobs=[torch.zeros(5)] * 2)
    with pytest.raises(ValueError, match="loss_mask\\[0\\]\\[0\\] is True"):
        PolicyBatch(ids, [torch.ones(5, dtype=torch.bool)], [torch.zeros(5)])
    with pytest.raises(ValueError, match="must be bool"):
        PolicyBatch(ids, [torch.ones(5)], [torch.zeros(5)])
    with pytest.raises(ValueError, match=r"old_logprobs\[0\] has 2 values for a response of 3"):
        PolicyBatch.from_responses([[1, 2]], [[3, 4, 5]], [1.0], old_logprobs=[[0.0, 0.0]])
    with pytest.raises(ValueError, match="2 prompts, 1 responses"):
        PolicyBatch.from_responses([[1], [2]], [[3]], [1.0, 2.0])


def test_batch_without_loss_tokens_or_behaviour_logprobs_is_rejected() -> None:
    trainer = Trainer(config(behav_imp_weight_cap=2.0), tiny_llama())
    batch = make_batch(0, [3, 4])
    with pytest.raises(ValueError, match="no behaviour_logprobs"):
        trainer.train_step(batch)
    batch.loss_mask = [torch.zeros_like(m) for m in batch.loss_mask]
    with pytest.raises(ValueError, match="no loss tokens"):
        trainer.train_step(batch)


def test_unknown_modes_and_keys_are_rejected_by_config() -> None:
    with pytest.raises(ValidationError, match="loss_agg_mode"):
        TrainerConfig(loss_agg_mode="seq-mean")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="kl_loss_type"):
        TrainerConfig(kl_loss_type="k4")  # type: ignore[arg-type]
    # actor.clip_ratio is verl's default for low/high (issue 31); unknown keys still fail
    with pytest.raises(ValidationError, match="clip_ratio_mid"):
        TrainerConfig.model_validate({"clip_ratio_mid": 0.2})
    # a cosine (or a warmup ratio) without a horizon fails when the schedule is built
    with pytest.raises(ValueError, match="cosine' needs total_training_steps"):
        OptimConfig(lr_scheduler_type="cosine").check_horizon()
    with pytest.raises(ValueError, match=r"lr_warmup_steps_ratio=0.1 needs total_training_steps"):
        OptimConfig(lr_warmup_steps_ratio=0.1).check_horizon()


def test_missing_model_directory_is_a_clear_error(tmp_path: object) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        Trainer(config(), str(tmp_path))


def test_bf16_compute_tracks_fp32_and_keeps_fp32_master_weights() -> None:
    batch = make_batch(11, [6, 9])
    fp32 = Trainer(config(), tiny_llama())
    bf16 = Trainer(config(param_dtype="bfloat16"), tiny_llama())
    for a, b in zip(fp32.compute_logprobs(batch), bf16.compute_logprobs(batch), strict=True):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, atol=0.1, rtol=0.05)
        assert not torch.equal(a, b)  # bf16 really ran
    metrics = bf16.train_step(batch)
    assert math.isfinite(metrics["actor/pg_loss"]) and bf16.step == 1
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
