"""verl's recipes in the orchestrator: rollout correction's keys and batch correction, the
couplings verl makes between sections, DAPO's overlong shaping, and the estimators verl has."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from patrl.orchestrator.config import ConfigError, load_config
from patrl.orchestrator.scoring import Sample
from patrl.orchestrator.step_metrics import mismatch_metrics
from patrl.orchestrator.update import correct_batch
from patrl.trainer import PolicyBatch

# ------------------------------------------------------------------ rollout correction keys


def test_rollout_correction_keys_load_under_verls_paths() -> None:
    cfg = load_config(
        None,
        [
            "algorithm.rollout_correction.rollout_is=sequence",
            "algorithm.rollout_correction.rollout_is_threshold=3.0",
            "algorithm.rollout_correction.rollout_is_batch_normalize=true",
            "algorithm.rollout_correction.rollout_rs=token_k1,seq_mean_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0,0.01",
        ],
    )
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize) == (
        "sequence",
        3.0,
        True,
    )
    assert (rc.rollout_rs, rc.rollout_rs_threshold) == ("token_k1,seq_mean_k3", "0.5_2.0,0.01")
    assert rc.rollout_is_threshold == 3.0 and not rc.bypass_mode
    assert cfg.actor.policy_loss.rollout_correction is None  # decoupled: the orchestrator's
    default = load_config(None, []).algorithm.rollout_correction
    assert (default.rollout_is, default.rollout_is_threshold, default.loss_type) == (
        None,
        2.0,
        "ppo_clip",
    )


def test_bypass_mode_hands_the_settings_to_the_actor_loss() -> None:
    cfg = load_config(
        None,
        [
            "algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.loss_type=reinforce",
            "algorithm.rollout_correction.rollout_is=token",
        ],
    )
    given = cfg.actor.policy_loss.rollout_correction
    assert given is not None and given == cfg.algorithm.rollout_correction
    # a dumped and reloaded config is the same config
    from patrl.orchestrator.config import JobConfig

    again = JobConfig.model_validate(cfg.model_dump())
    assert again.actor.policy_loss.rollout_correction == given


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.rollout_correction.rollout_is=tokens"], "rollout_is"),
        (["algorithm.rollout_correction.rollout_rs=token_k1"], "needs rollout_rs_threshold"),
        (["algorithm.rollout_correction.loss_type=reinforce"], "bypass mode only"),
        (
            ["algorithm.rollout_correction.rollout_is=token", "trainer.mode=async"],
            "async_rl.behaviour_weight_cap",
        ),
        (
            ["actor.policy_loss.rollout_correction.bypass_mode=true"],
            "set algorithm.rollout_correction",
        ),
        (
            ["actor_rollout_ref.actor.tis_imp_ratio_cap=2.0"],
            r"rollout_is=token .*rollout_is_threshold=<the cap>",
        ),
    ],
)
def test_rollout_correction_refusals_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_tis_cap_off_is_accepted_silently() -> None:
    notes: list[str] = []
    load_config(None, ["actor_rollout_ref.actor.tis_imp_ratio_cap=-1"], notes)
    assert notes == []


# ------------------------------------------------------------------ the batch's correction


def _samples() -> tuple[list[Sample], list[torch.Tensor]]:
    """Three samples (prompt 2 tokens, responses 3, 2, 4) and trainer logprobs that differ
    from the engine's by +0.2, +1.0 and -0.1 per token."""
    shifts = [0.2, 1.0, -0.1]
    samples, old = [], []
    for i, (n, d) in enumerate(zip([3, 2, 4], shifts, strict=True)):
        engine = [-0.5 - 0.1 * t for t in range(n)]
        samples.append(Sample(i // 2, [1, 2], [5 + t for t in range(n)], engine, "stop", 1.0))
        old.append(torch.tensor([0.0, 0.0] + [v + d for v in engine]))
    return samples, old


def _batch(samples: list[Sample], old: list[torch.Tensor]) -> PolicyBatch:
    batch = PolicyBatch.from_responses(
        [s.prompt_token_ids for s in samples], [s.token_ids for s in samples], [1.0] * 3
    )
    batch.old_logprobs = old
    return batch


def test_decoupled_correction_weights_the_batch_and_drops_rejected_tokens() -> None:
    samples, old = _samples()
    cfg = load_config(
        None,
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=2.0",
        ],
    )
    batch = _batch(samples, old)
    metrics = correct_batch(cfg, batch, samples)
    assert batch.rollout_is_weights is not None
    for i, (s, d) in enumerate(zip(samples, [0.2, 1.0, -0.1], strict=True)):
        w = batch.rollout_is_weights[i]
        assert w[:2].tolist() == [0.0, 0.0]  # zero on the prompt
        assert w[2:].tolist() == pytest.approx([min(math.exp(d), 2.0)] * len(s.token_ids))
        # seq_mean_k1 keeps -log 2 <= mean(-(old - engine)) <= log 2: sample 1 (d = 1) goes
        assert batch.loss_mask[i][2:].all().item() == (i != 1)
        assert not batch.loss_mask[i][:2].any()
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 9)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    want_kl = -(0.2 * 3 + 1.0 * 2 - 0.1 * 4) / 9
    assert metrics["rollout_corr/kl"] == pytest.approx(want_kl, rel=1e-6)
    # verl's rollout_is_mean is taken before the truncation
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(
        (3 * math.exp(0.2) + 2 * math.e + 4 * math.exp(-0.1)) / 9, rel=1e-6
    )


def test_mismatch_metrics_every_step_keep_what_the_correction_reported() -> None:
    samples, old = _samples()
    got = mismatch_metrics(samples, old, {})
    assert got["rollout_corr/kl"] == pytest.approx(-(0.6 + 2.0 - 0.4) / 9, rel=1e-6)
    seq = [0.2, 1.0, -0.1]  # per-sequence mean logprob differences (train - rollout)
    assert got["rollout_corr/log_ppl_diff"] == pytest.approx(-sum(seq) / 3, rel=1e-6)
    assert "rollout_corr/kl" not in mismatch_metrics(samples, old, {"rollout_corr/kl": 0.0})


# ------------------------------------------------------------------ DAPO overlong shaping


def _verl_overlong(
    valid_response_length: int, max_resp_len: int, buffer: int, factor: float
) -> float:
    """verl's DAPORewardManager.__call__, the overlong part, transcribed."""
    overlong_buffer_len = buffer
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    overlong_penalty_factor = factor
    return min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)


def test_overlong_penalty_matches_verl_and_is_added_to_the_reward() -> None:
    from patrl.orchestrator.rewards import OverlongBuffer, RewardResult, add_overlong_penalty

    ob = OverlongBuffer(buffer=4, penalty_factor=0.5, max_len=10, log=True)
    lengths = [1, 6, 7, 9, 10]
    result = RewardResult(rewards=[1.0, 1.0, 0.0, 2.0, 1.0], components={"f": [1.0] * 5})
    penalties = add_overlong_penalty(result, lengths, ob)
    for n, p in zip(lengths, penalties, strict=True):
        assert p == _verl_overlong(n, 10, 4, 0.5)
        # the loop twin: nothing up to 6 tokens, then linear to -0.5 at the full budget
        assert p == pytest.approx(-0.5 * max(n - 6, 0) / 4)
    assert result.rewards == pytest.approx([1.0, 1.0, -0.125, 1.625, 0.5])
    m = result.metrics()
    assert m["reward/overlong_reward/mean"] == pytest.approx(sum(penalties) / 5)
    assert m["reward/overlong/mean"] == pytest.approx(3 / 5)


def test_overlong_keys_load_and_bad_buffers_are_refused() -> None:
    cfg = load_config(
        None,
        [
            "data.max_response_length=16",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=4",
            "reward_model.overlong_buffer.penalty_factor=1.0",
            "reward_model.reward_manager=dapo",
        ],
    )
    from patrl.orchestrator.scoring import overlong_buffer

    ob = overlong_buffer(cfg)
    assert ob is not None and (ob.buffer, ob.penalty_factor, ob.max_len) == (4, 1.0, 16)
    assert overlong_buffer(load_config(None, [])) is None
    for length in (0, 17):
        with pytest.raises(ConfigError, match=rf"overlong_buffer.len={length}.*<= data.max"):
            load_config(
                None,
                [
                    "data.max_response_length=16",
                    "reward_model.overlong_buffer.enable=true",
                    f"reward_model.overlong_buffer.len={length}",
                ],
            )


def test_filter_metric_acc_compares_the_score_before_the_penalty() -> None:
    from patrl.orchestrator.scoring import filter_value

    s = Sample(0, [1], [2, 3], [-0.1, -0.1], "length", reward=0.5, overlong=-0.5)
    acc = load_config(
        None, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]
    )
    assert filter_value(acc, s) == 1.0
    assert filter_value(load_config(None, []), s) == 0.5


def test_gen_batch_size_sets_the_epoch_and_needs_dynamic_sampling() -> None:
    from patrl.orchestrator.config import resolve_schedule

    cfg = load_config(
        None,
        [
            "data.train_batch_size=8",
            "data.gen_batch_size=24",
            "algorithm.filter_groups.enable=true",
            "trainer.total_epochs=2",
        ],
    )
    assert resolve_schedule(cfg, 100).trainer.total_training_steps == 2 * (100 // 24)
    with pytest.raises(ConfigError, match=r"gen_batch_size=24 .*filter_groups\.enable=true"):
        load_config(None, ["data.train_batch_size=8", "data.gen_batch_size=24"])


# ------------------------------------------------------------------ verl's semantics


def test_critic_loss_agg_mode_follows_the_actors_unless_set() -> None:
    cfg = load_config(None, ["actor.loss_agg_mode=seq-mean-token-mean"])
    assert cfg.critic.loss_agg_mode == "seq-mean-token-mean"
    cfg = load_config(
        None, ["actor.loss_agg_mode=seq-mean-token-mean", "critic.loss_agg_mode=token-mean"]
    )
    assert cfg.critic.loss_agg_mode == "token-mean"
    from patrl.orchestrator.build import critic_config

    assert critic_config(
        load_config(None, ["actor.loss_agg_mode=seq-mean-token-sum"])
    ).loss_agg_mode == ("seq-mean-token-sum")


def test_deliberate_differences_from_verl_are_said_at_start_up() -> None:
    notes: list[str] = []
    load_config(None, ["actor.loss_agg_mode=seq-mean-token-sum-norm"], notes)
    assert any("Dr.GRPO's 1/G" in n and "verl's agg_loss" in n for n in notes)
    notes = []
    load_config(None, ["actor.policy_loss.loss_mode=gspo"], notes)
    assert any("gspo aggregates the policy loss seq-mean-token-mean" in n for n in notes)
    notes = []
    load_config(
        None, ["actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean"], notes
    )
    assert notes == []
    rc = "algorithm.rollout_correction"
    for overrides, said in (
        ([f"{rc}.bypass_mode=true", "algorithm.use_kl_in_reward=true"], "verl's takes the rollout"),
        (
            [
                f"{rc}.rollout_rs=token_k1",
                f"{rc}.rollout_rs_threshold=2.0",
                "algorithm.adv_estimator=reinforce_plus_plus",
            ],
            "count in the whitening statistics",
        ),
        (
            [
                f"{rc}.bypass_mode=true",
                f"{rc}.rollout_is=token",
                f"{rc}.rollout_is_batch_normalize=true",
            ],
            "per micro-batch on each rank",
        ),
    ):
        notes = []
        load_config(None, overrides, notes)
        assert any(said in n for n in notes), (overrides, notes)
    notes = []  # the same corrections where nothing differs: no note
    load_config(None, [f"{rc}.rollout_rs=token_k1", f"{rc}.rollout_rs_threshold=2.0"], notes)
    assert notes == []


def test_gspo_aggregates_seq_mean_token_mean_whatever_loss_agg_mode_says() -> None:
    from patrl.trainer import TrainerConfig
    from patrl.trainer.config import PolicyLossConfig

    gspo = TrainerConfig(policy_loss=PolicyLossConfig(loss_mode="gspo"), loss_agg_mode="token-mean")
    assert gspo.policy_agg_mode == "seq-mean-token-mean"
    assert TrainerConfig(loss_agg_mode="seq-mean-token-sum").policy_agg_mode == "seq-mean-token-sum"


# ------------------------------------------------------------------ verl's other estimators

# Nine samples in three groups of 3 (one with a tie for the best), lengths for OPO.
EST_SCORES = np.array([1.0, 0.0, 0.5, 2.0, 2.0, -1.0, 0.0, 0.25, 3.0])
EST_GROUPS = np.array([4, 4, 4, 1, 1, 1, 9, 9, 9])
EST_LENGTHS = [3, 1, 4, 2, 2, 5, 1, 6, 2]


def _verl_passk(scores: torch.Tensor, index: np.ndarray, norm: bool) -> torch.Tensor:
    """compute_grpo_passk_outcome_advantage on scores (one per sample), transcribed."""
    epsilon = 1e-6
    advantages = torch.zeros_like(scores)
    id2scores: dict = defaultdict(list)
    id2indices: dict = defaultdict(list)
    for i in range(scores.shape[0]):
        id2scores[index[i]].append(scores[i])
        id2indices[index[i]].append(i)
    for idx in id2scores:
        rewards = torch.stack(id2scores[idx])
        topk, topk_idx = torch.topk(rewards, 2)
        r_max, r_second_max = topk[0], topk[1]
        i_max = id2indices[idx][topk_idx[0].item()]
        advantage = r_max - r_second_max
        if norm:
            advantage = advantage / (torch.std(rewards) + epsilon)
        advantages[i_max] = advantage
    return advantages


def _verl_opo(scores: torch.Tensor, lengths: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """compute_opo_outcome_advantage, transcribed."""
    id2score: dict = defaultdict(list)
    id2len: dict = defaultdict(list)
    id2bsl = {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
        id2len[index[i]].append(lengths[i])
    for idx in id2score:
        score_tensor = torch.stack(id2score[idx])
        len_tensor = torch.stack(id2len[idx])
        id2bsl[idx] = (len_tensor * score_tensor).sum() / len_tensor.sum()
    out = scores.clone()
    for i in range(scores.shape[0]):
        out[i] = scores[i] - id2bsl[index[i]]
    return out


def _verl_gpg(scores: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """compute_gpg_outcome_advantage (f_norm 1), transcribed."""
    id2score: dict = defaultdict(list)
    id2mean = {}
    bsz = scores.shape[0]
    m = torch.count_nonzero(scores)
    alpha = bsz / m.clamp(min=1)
    for i in range(bsz):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
    out = scores.clone()
    for i in range(bsz):
        out[i] = alpha * (scores[i] - id2mean[index[i]]) / 1.0
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_verl_and_loop(norm: bool) -> None:
    from patrl.orchestrator.advantages import compute_advantages

    ours = compute_advantages("grpo_passk", EST_SCORES, EST_GROUPS, norm_adv_by_std_in_grpo=norm)
    theirs = _verl_passk(torch.from_numpy(EST_SCORES.copy()), EST_GROUPS, norm).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0)
    for g in set(EST_GROUPS.tolist()):
        idx = [i for i in range(9) if EST_GROUPS[i] == g]
        vals = sorted((EST_SCORES[i] for i in idx), reverse=True)
        best = max(idx, key=lambda i: (EST_SCORES[i], -i))
        mean = sum(vals) / 3
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 2)
        want = (vals[0] - vals[1]) / ((std + 1e-6) if norm else 1.0)
        for i in idx:
            assert ours[i] == pytest.approx(want if i == best else 0.0, abs=1e-12)


def test_opo_and_gpg_match_verl_and_loop() -> None:
    from patrl.orchestrator.advantages import compute_advantages

    opo = compute_advantages("opo", EST_SCORES, EST_GROUPS, lengths=EST_LENGTHS)
    theirs = _verl_opo(
        torch.from_numpy(EST_SCORES.copy()),
        torch.tensor(EST_LENGTHS, dtype=torch.float64),
        EST_GROUPS,
    )
    np.testing.assert_allclose(opo, theirs.numpy(), rtol=1e-12, atol=1e-15)
    gpg = compute_advantages("gpg", EST_SCORES, EST_GROUPS)
    # verl divides the batch size by an integer tensor: its alpha is fp32
    np.testing.assert_allclose(
        gpg, _verl_gpg(torch.from_numpy(EST_SCORES.copy()), EST_GROUPS).numpy(), rtol=1e-6
    )
    alpha = 9 / sum(1 for r in EST_SCORES if r != 0)
    for i in range(9):
        group = [j for j in range(9) if EST_GROUPS[j] == EST_GROUPS[i]]
        base = sum(EST_LENGTHS[j] * EST_SCORES[j] for j in group) / sum(
            EST_LENGTHS[j] for j in group
        )
        assert opo[i] == pytest.approx(EST_SCORES[i] - base, rel=1e-12)
        mean = sum(EST_SCORES[j] for j in group) / len(group)
        assert gpg[i] == pytest.approx(alpha * (EST_SCORES[i] - mean), rel=1e-12)


def test_vectorized_names_are_verls_aliases_and_estimators_load() -> None:
    from patrl.orchestrator.advantages import compute_advantages

    for alias, name in (("grpo_vectorized", "grpo"), ("rloo_vectorized", "rloo")):
        np.testing.assert_array_equal(
            compute_advantages(alias, EST_SCORES, EST_GROUPS),
            compute_advantages(name, EST_SCORES, EST_GROUPS),
        )
    for name in ("grpo_passk", "opo", "gpg", "grpo_vectorized", "rloo_vectorized"):
        assert (
            load_config(None, [f"algorithm.adv_estimator={name}"]).algorithm.adv_estimator == name
        )
        with pytest.raises(ConfigError, match=r"rollout\.n=1"):
            load_config(None, [f"algorithm.adv_estimator={name}", "rollout.n=1"])


def test_a_correction_that_rejects_everything_stops_naming_the_threshold() -> None:
    from patrl.orchestrator.errors import JobError

    samples, old = _samples()
    cfg = load_config(
        None,
        [
            "algorithm.rollout_correction.rollout_rs=token_k2",
            "algorithm.rollout_correction.rollout_rs_threshold=1e-6",
        ],
    )
    with pytest.raises(JobError, match=r"rollout_rs=token_k2 rejected every token.*1e-6"):
        correct_batch(cfg, _batch(samples, old), samples)


def test_every_preset_row_of_docs_verl_md_loads() -> None:
    """verl's RolloutCorrectionConfig presets, written as keys in docs/verl.md: each row loads
    (its thresholds parse) and says what verl's constructor sets."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "verl.md").read_text()
    table = doc.split("<!-- rollout-presets:start -->", 1)[1].split("<!-- rollout-presets:end", 1)
    rows = [r for r in table[0].splitlines() if r.startswith("| `") and "=" in r]
    assert len(rows) == 16
    for row in rows:
        keys = row.split("|")[2].strip().strip("`").split()
        cfg = load_config(None, [f"algorithm.rollout_correction.{k}" for k in keys])
        rc = cfg.algorithm.rollout_correction
        for key in keys:
            name, value = key.split("=")
            got = getattr(rc, name)
            assert str(got).lower() == value.lower() or got == float(value), (row, name)


def test_main_ppos_reward_kwargs_form_of_the_overlong_buffer() -> None:
    """verl's recipe/dapo/test_dapo_7b_math.sh (verl.trainer.main_ppo) passes the buffer as
    Hydra additions under reward_kwargs.overlong_buffer_cfg."""
    cfg = load_config(
        None,
        [
            "data.max_response_length=8192",
            "reward_model.reward_manager=dapo",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
        ],
    )
    ob = cfg.reward_model.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor, ob.log) == (True, 4096, 1.0, False)


def test_covariance_loss_keys_are_verls_and_bypass_keeps_the_vanilla_loss() -> None:
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
            "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.002",
            "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1.0",
        ],
    )
    p = cfg.actor.policy_loss
    assert (p.loss_mode, p.kl_cov_ratio, p.ppo_kl_coef, p.clip_cov_ub) == (
        "kl_cov",
        0.002,
        1.0,
        5.0,
    )
    with pytest.raises(ConfigError, match="bypass mode replaces the policy loss"):
        load_config(
            None,
            ["algorithm.rollout_correction.bypass_mode=true", "actor.policy_loss.loss_mode=gspo"],
        )
