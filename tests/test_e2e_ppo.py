"""PPO with a critic (algorithm.adv_estimator=gae) end to end on the tiny model: the critic's
metrics, critic warmup, the separate values pass, resume of actor + critic, and learning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_e2e_grpo import make_loop

from patrl.orchestrator import preflight
from patrl.orchestrator.config import ConfigError, load_config
from patrl.orchestrator.distributed import World

GAE: dict[str, Any] = {
    "algorithm.adv_estimator": "gae",
    "algorithm.gamma": 1.0,
    "algorithm.lam": 0.95,
    "critic.optim.lr": 3e-3,
}
# these tests do not validate
NO_VAL = {"trainer.test_freq": 0, "trainer.val_before_train": "false"}
CRITIC_KEYS = (
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/vf_explained_var",
    "critic/values/mean",
    "critic/values/max",
    "critic/values/min",
    "critic/returns/mean",
    "critic/returns/max",
    "critic/returns/min",
    "critic/grad_norm",
    "timing_s/update_critic",
)
WORLD = World(0, 1, 0, torch.device("cpu"))


def _rows(history: list[dict[str, float]]) -> list[dict[str, float]]:
    return [h for h in history if "critic/score/mean" in h]


@pytest.mark.e2e
def test_gae_logs_the_critic_and_waits_for_critic_warmup(assets: Path, tmp_path: Path) -> None:
    extra = {**GAE, "algorithm.lam": 1.0, "trainer.critic_warmup": 1, **NO_VAL}
    loop = make_loop(assets, tmp_path, WORLD, **extra)
    assert loop.critic is not None
    first, second = _rows(loop.run().history)
    for row in (first, second):
        assert all(k in row for k in CRITIC_KEYS), [k for k in CRITIC_KEYS if k not in row]
        # gamma = lam = 1: every token's return is its sequence's score
        assert row["critic/returns/max"] == pytest.approx(row["critic/score/max"], abs=1e-6)
        assert row["critic/returns/min"] == pytest.approx(row["critic/score/min"], abs=1e-6)
    assert "actor/pg_loss" not in first and "timing_s/update_actor" not in first
    assert "actor/pg_loss" in second and "training/rollout_probs_diff_max" in second
    assert second["training/rollout_probs_diff_max"] < 1e-4
    # two mini-batches (the critic follows the actor's): the values come from their own pass
    assert "timing_s/values" in first


@pytest.mark.e2e
def test_one_critic_step_takes_values_from_its_update(assets: Path, tmp_path: Path) -> None:
    extra = {**GAE, "actor.ppo_mini_batch_size": 4, **NO_VAL}
    rows = _rows(make_loop(assets, tmp_path, WORLD, **extra).run().history)
    assert all("timing_s/values" not in r and "timing_s/old_log_prob" not in r for r in rows)
    assert all(r["critic/vf_loss"] > 0 for r in rows)


@pytest.mark.e2e
def test_gae_with_kl_in_the_reward_penalises_the_token_rewards(
    assets: Path, tmp_path: Path
) -> None:
    """The RLHF recipe: GAE over token rewards that carry an adaptive KL penalty. With
    gamma = lam = 1 a token's return is the sum of the rewards from it on, so the KL
    penalty shows as returns that differ from the scores once the policy moved."""
    extra = {
        **GAE,
        "algorithm.lam": 1.0,
        "algorithm.use_kl_in_reward": True,
        "algorithm.kl_penalty": "low_var_kl",  # k3 >= 0, so the penalty's sign is known
        "algorithm.kl_ctrl.type": "adaptive",
        "algorithm.kl_ctrl.kl_coef": 0.5,
        "trainer.total_training_steps": 3,
        **NO_VAL,
    }
    loop = make_loop(assets, tmp_path, WORLD, **extra)
    rows = _rows(loop.run().history)
    assert len(rows) == 3
    for row in rows:
        assert all(k in row for k in CRITIC_KEYS)
        assert "actor/reward_kl_penalty" in row and "timing_s/ref" in row
    assert rows[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)  # pi == pi_ref
    assert rows[-1]["actor/reward_kl_penalty"] > 0
    assert rows[-1]["actor/reward_kl_penalty_coeff"] != 0.5  # the adaptive controller moved
    moved = rows[-1]
    assert moved["critic/returns/max"] != pytest.approx(moved["critic/score/max"], abs=1e-9)


KEYS = (
    "critic/score/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/values/mean",
    "critic/vf_explained_var",
    "critic/grad_norm",
)


@pytest.mark.e2e
def test_resume_restores_actor_and_critic(assets: Path, tmp_path: Path) -> None:
    """... and with hf_model in critic.checkpoint.save_contents the checkpoint holds the critic
    as a Hugging Face token-classification model (critic/huggingface)."""
    from transformers import AutoModelForTokenClassification

    from patrl.orchestrator import run_checkpoint

    four = {**GAE, "trainer.total_training_steps": 4, **NO_VAL}
    straight = make_loop(assets, tmp_path / "a", WORLD, **four).run()
    two = {**four, "trainer.total_training_steps": 2}
    two["critic.checkpoint.save_contents"] = "[model,optimizer,extra,hf_model]"
    first = make_loop(assets, tmp_path / "b", WORLD, **two)
    first.run()
    checkpoint = run_checkpoint.step_dir(first.run_dir, 2)
    critic_hf = checkpoint / run_checkpoint.CRITIC_DIR / run_checkpoint.HF_DIR
    model = AutoModelForTokenClassification.from_pretrained(critic_hf, dtype=torch.float32)
    assert first.critic is not None
    live = dict(first.critic.model.named_parameters())
    for name, t in model.named_parameters():
        assert torch.equal(t, live[name].detach()), name
    assert (run_checkpoint.hf_dir(checkpoint) / "model.safetensors").is_file()  # the policy's
    resumed = make_loop(assets, tmp_path / "b", WORLD, **four).run()
    assert resumed.steps == 4

    def tail(history: list[dict[str, float]]) -> list[list[float]]:
        return [[h[k] for k in KEYS] for h in _rows(history) if h["step"] > 2]

    assert len(tail(straight.history)) == 2
    # Bit-exact: a resume of a deterministic run, same world, same batches and shapes, from
    # bit-exact saved state (weights, optimiser, RNG), so every float is recomputed identically.
    assert tail(resumed.history) == tail(straight.history)


@pytest.mark.e2e
def test_resume_without_a_saved_critic_says_so(assets: Path, tmp_path: Path) -> None:
    make_loop(assets, tmp_path, WORLD, **NO_VAL).run()
    extra = {**GAE, "trainer.total_training_steps": 3, **NO_VAL}
    with pytest.raises(ValueError, match=r"has no critic/ .*adv_estimator=gae"):
        make_loop(assets, tmp_path, WORLD, **extra).run()


@pytest.mark.e2e
def test_preflight_names_a_bad_critic_path_and_a_checkpoint_without_critic(
    assets: Path, tmp_path: Path
) -> None:
    make_loop(assets, tmp_path, WORLD, **NO_VAL).run()  # a GRPO checkpoint
    overrides = [
        f"model.path={assets / 'model'}",
        f"data.train_files={assets / 'train.jsonl'}",
        f"trainer.default_local_dir={tmp_path}",
        "algorithm.adv_estimator=gae",
        f"critic.model.path={tmp_path / 'nowhere'}",
    ]
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check(load_config(None, overrides), world_size=1)
    problems = err.value.problems
    assert any(p.startswith("critic.model.path=") and "no config.json" in p for p in problems)
    assert any(p.startswith("trainer.resume_mode: ") and "has no critic/" in p for p in problems)


def test_critic_mini_batch_must_divide_the_batch() -> None:
    with pytest.raises(ConfigError, match=r"critic\.ppo_mini_batch_size=3 must divide"):
        load_config(None, ["critic.ppo_mini_batch_size=3"])


@pytest.mark.e2e
def test_the_critic_learns_the_dense_reward(assets: Path, tmp_path: Path) -> None:
    """On the digit-share reward, 15 PPO steps: the critic's explained variance must rise from
    about 0 (a new, zero head) to clearly above 0, and the reward must rise (the critic takes
    4 epochs per batch: its own ppo_epochs, apart from the actor's one step)."""
    extra = {
        **GAE,
        "critic.ppo_epochs": 4,
        "data.train_batch_size": 8,
        "actor.ppo_mini_batch_size": 8,
        "rollout.n": 8,
        "trainer.total_training_steps": 15,
        **NO_VAL,
    }
    rows = _rows(make_loop(assets, tmp_path, WORLD, **extra).run().history)
    ev = [r["critic/vf_explained_var"] for r in rows]
    first, last = sum(ev[:3]) / 3, sum(ev[-3:]) / 3
    assert abs(ev[0]) < 0.05, ev  # a zero head: values 0, nothing explained yet
    assert last > 0.2 and last > first + 0.15, f"explained variance {first:.3f} -> {last:.3f}: {ev}"
    rewards = [r["critic/score/mean"] for r in rows]
    assert sum(rewards[-3:]) / 3 >= sum(rewards[:3]) / 3 + 0.05, rewards
    assert all("timing_s/values" in r for r in rows)  # several critic steps: a values pass


def _two_rank_gae(rank: int, world_size: int, assets: Path, run_dir: Path) -> dict[str, Any]:
    world = World(rank, world_size, rank, torch.device("cpu"))
    extra = {
        **GAE,
        "rollout.adaptive_tp.enable": False,  # static: two data-parallel replicas
        **NO_VAL,
        "trainer.total_training_steps": 2,
    }
    loop = make_loop(assets, run_dir, world, **extra)
    result = loop.run()
    assert loop.critic is not None
    head = dict(loop.critic.model.named_parameters())["score.weight"]
    return {"history": result.history, "head_norm": float(head.full_tensor().norm())}


@pytest.mark.e2e
@pytest.mark.multirank
def test_two_ranks_train_and_checkpoint_the_critic(assets: Path, tmp_path: Path) -> None:
    from patrl.orchestrator import run_checkpoint
    from patrl_testkit.multirank import run_ranks

    ranks = run_ranks(_two_rank_gae, world_size=2, args=(assets, tmp_path), timeout_s=300)
    rows = _rows(ranks[0]["history"])
    assert len(rows) == 2 and all(all(k in r for k in CRITIC_KEYS) for r in rows)
    assert ranks[0]["head_norm"] == ranks[1]["head_norm"] > 0  # the zero head moved, alike
    saved = run_checkpoint.latest_checkpoint(tmp_path)
    assert saved is not None and (saved / run_checkpoint.CRITIC_DIR).is_dir()
