"""REINFORCE++ with KL in the reward (adaptive), GSPO, Dr.GRPO's aggregation and ReMax through
the real sync loop on a tiny random model, one rank; the reference is built and run only for a KL term."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl_testkit.jobs import write_addition_task


def run(assets: Path, run_dir: Path, **extra: Any) -> tuple[SyncGRPO, list[dict[str, float]]]:
    base: dict[str, Any] = {
        "model.path": assets / "model",
        "data.train_files": assets / "train.jsonl",
        "data.train_batch_size": 4,
        "data.max_prompt_length": 32,
        "data.max_response_length": 16,
        "actor.ppo_mini_batch_size": 4,
        "actor.optim.lr": 1e-3,
        "rollout.n": 2,
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 128,
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
        "reward.num_workers": 0,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": run_dir,
    }
    base.update(extra)
    config = load_config(None, [f"{k}={v}" for k, v in base.items()])
    loop = SyncGRPO(
        config,
        World(0, 1, 0, torch.device("cpu")),
        str(assets / "model"),
        config.data.train_files,
        None,
    )
    history = loop.run().history
    return loop, [h for h in history if "critic/score/mean" in h]


@pytest.mark.e2e
def test_reinforce_plus_plus_with_adaptive_kl_in_reward(assets: Path, tmp_path: Path) -> None:
    horizon, kl_coef = 10, 0.05
    loop, steps = run(
        assets,
        tmp_path,
        **{
            "algorithm.adv_estimator": "reinforce_plus_plus",
            "algorithm.use_kl_in_reward": "true",
            "algorithm.kl_penalty": "low_var_kl",
            "algorithm.kl_ctrl.type": "adaptive",
            "algorithm.kl_ctrl.kl_coef": kl_coef,
            "algorithm.kl_ctrl.target_kl": 0.1,
            "algorithm.kl_ctrl.horizon": horizon,
            "actor.policy_loss.loss_mode": "gspo",
        },
    )
    assert len(steps) == 2
    assert loop.trainer.reference is not None
    first, second = steps
    for key in ("timing_s/ref", "timing_s/old_log_prob", "actor/reward_kl_penalty"):
        assert key in first and key in second
    # Step 1: the policy is the reference, so no KL, and the controller lowers the coefficient
    # by the full 20% error over 8 samples of a horizon of 10.
    assert first["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert first["actor/reward_kl_penalty_coeff"] == kl_coef
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(
        kl_coef * (1 - 0.2 * 8 / horizon)
    )
    assert second["actor/reward_kl_penalty"] > 0.0  # one update moved the policy off the reference
    # verl's critic/rewards/*: the scores after the KL penalty (none yet at step 1).
    assert first["critic/rewards/mean"] == pytest.approx(first["critic/score/mean"], abs=1e-6)
    assert second["critic/rewards/mean"] < second["critic/score/mean"]
    assert second["critic/rewards/min"] <= second["critic/rewards/mean"]
    assert second["actor/grad_norm"] > 0.0


@pytest.mark.e2e
def test_no_kl_term_builds_and_runs_no_reference(assets: Path, tmp_path: Path) -> None:
    loop, steps = run(assets, tmp_path, **{"trainer.total_training_steps": 1})
    assert loop.trainer.reference is None
    assert steps and not any("timing_s/ref" in h for h in steps)
    assert not any("actor/reward_kl_penalty" in h for h in steps)
    assert "timing_s/old_log_prob" not in steps[0]  # one update: the fused old logprobs
    for key in ("mean", "max", "min"):  # no KL in the reward: the rewards are the scores
        assert steps[0][f"critic/rewards/{key}"] == steps[0][f"critic/score/{key}"]


@pytest.mark.e2e
def test_baseline_estimator_with_kl_loss_and_sum_norm(assets: Path, tmp_path: Path) -> None:
    loop, steps = run(
        assets,
        tmp_path,
        **{
            "algorithm.adv_estimator": "reinforce_plus_plus_baseline",
            "actor.use_kl_loss": "true",
            "actor.loss_agg_mode": "seq-mean-token-sum-norm",
            "trainer.total_training_steps": 2,
        },
    )
    assert loop.trainer.reference is not None
    assert all("timing_s/ref" in h for h in steps)
    assert not any("actor/reward_kl_penalty" in h for h in steps)
    assert steps[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert steps[1]["actor/kl_loss"] > 0.0
    # whitened advantages: mean 0 over the batch's response tokens
    assert all(abs(h["critic/advantages/mean"]) < 1e-6 for h in steps)


@pytest.mark.e2e
def test_adaptive_kl_coefficient_survives_resume(assets: Path, tmp_path: Path) -> None:
    kl = {
        "algorithm.adv_estimator": "reinforce_plus_plus",
        "algorithm.use_kl_in_reward": "true",
        "algorithm.kl_ctrl.type": "adaptive",
        "algorithm.kl_ctrl.horizon": 10,
    }
    _, straight = run(assets, tmp_path / "a", **kl, **{"trainer.total_training_steps": 3})
    run(assets, tmp_path / "b", **kl, **{"trainer.save_freq": 1})
    _, resumed = run(assets, tmp_path / "b", **kl, **{"trainer.total_training_steps": 3})
    assert [h["step"] for h in resumed] == [1.0, 2.0, 3.0]  # steps 1-2 from the saved log
    coeff = "actor/reward_kl_penalty_coeff"
    assert straight[2][coeff] != straight[0][coeff]
    assert resumed[2][coeff] == pytest.approx(straight[2][coeff], rel=1e-12)


@pytest.mark.e2e
def test_remax_baseline_is_the_greedy_response_reward(assets: Path, tmp_path: Path) -> None:
    """ReMax with one sample per prompt on a 4-prompt set that is also the validation set:
    step k's baseline is the reward of each prompt's greedy response under the weights that
    sampled the step, which is what the greedy validation right before step k measured."""
    write_addition_task(tmp_path, {"four": 4})
    four = tmp_path / "four.jsonl"
    config = load_config(
        None,
        [
            f"model.path={assets / 'model'}",
            f"data.train_files={four}",
            f"data.val_files={four}",
            "data.train_batch_size=4",
            "data.max_prompt_length=32",
            "data.max_response_length=16",
            "actor.ppo_mini_batch_size=4",
            "actor.optim.lr=1e-3",
            "algorithm.adv_estimator=remax",
            "rollout.n=1",
            "rollout.block_size=4",
            "rollout.num_kv_blocks=128",
            "reward.functions=[{name: patrl_testkit.jobs:digit_reward}]",
            "reward.num_workers=0",
            "trainer.total_training_steps=2",
            "trainer.test_freq=1",
            "trainer.logger=[jsonl]",
            "trainer.plots=false",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    files = (config.data.train_files, config.data.val_files)
    loop = SyncGRPO(config, World(0, 1, 0, torch.device("cpu")), str(assets / "model"), *files)
    history = loop.run().history
    val = {int(h["step"]): h["val-core/acc/mean@1"] for h in history if "val-core/acc/mean@1" in h}
    steps = {int(h["step"]): h for h in history if "critic/score/mean" in h}
    assert sorted(val) == [0, 1, 2] and sorted(steps) == [1, 2]
    for k in (1, 2):
        row = steps[k]
        assert row["remax/baseline_score/mean"] == pytest.approx(val[k - 1], abs=1e-9)
        assert "timing_s/gen_max" in row and row["remax/baseline_response_length/mean"] > 0
        # One sample per prompt: its advantage on the first token is its reward minus the
        # baseline, so the mean advantage is not forced to 0 as whitening would.
        assert row["actor/grad_norm"] > 0.0
    # The update moved the policy: the second baseline saw other weights than the first.
    assert (
        val[1] != val[0]
        or steps[2]["remax/baseline_response_length/mean"]
        != steps[1]["remax/baseline_response_length/mean"]
    )
