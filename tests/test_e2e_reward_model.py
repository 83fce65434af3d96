"""GRPO end to end with a learned reward model: the RM (with its own chat template, so samples
are re-encoded) scores every training sample, its weighted score joins the rule reward, and
reward_model/score/* is logged; on 2 ranks the FSDP2-sharded RM scores as the replicated one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl_examples.demo.tokenizer import build_tokenizer
from patrl_testkit.jobs import addition_job
from patrl_testkit.models import save_tiny_reward_model
from patrl_testkit.multirank import run_ranks

WEIGHT = 0.5


def digit_share(response: str, answer: str, **meta: Any) -> float:
    return sum(c.isdigit() for c in response) / max(1, len(response))


def rm_job(tmp_path: Path) -> tuple[Path, Path]:
    """(the job's assets, an RM with its own chat template)."""
    assets = addition_job(tmp_path / "job")
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    return assets, save_tiny_reward_model(tmp_path / "rm", tok, seed=1)


def rm_overrides(assets: Path, rm: Path, runs: Path, **extra: Any) -> list[str]:
    overrides = {
        "model.path": assets / "model",
        "data.train_files": assets / "train.jsonl",
        "data.val_files": assets / "val.jsonl",
        "data.train_batch_size": 4,
        "data.max_prompt_length": 32,
        "data.max_response_length": 12,
        "actor.ppo_mini_batch_size": 4,
        "rollout.n": 2,
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 64,
        "reward.functions": '[{name: "test_e2e_reward_model:digit_share"}]',
        "reward.num_workers": 0,
        "reward_model.enable": "true",
        "reward_model.model.path": rm,
        "reward_model.weight": WEIGHT,
        "reward_model.micro_batch_size": 3,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": runs,
        **extra,
    }
    return [f"{k}={v}" for k, v in overrides.items()]


@pytest.mark.e2e
def test_grpo_with_a_reward_model_logs_its_scores(tmp_path: Path) -> None:
    assets, rm = rm_job(tmp_path)
    config = load_config(None, rm_overrides(assets, rm, tmp_path / "runs"))
    world = World(0, 1, 0, torch.device("cpu"))
    loop = SyncGRPO(config, world, str(assets / "model"), config.data.train_files, None)
    assert loop.learned is not None and not loop.learned.encoder.same
    loop.run()
    lines = (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if "critic/score/mean" in json.loads(x)]
    assert len(steps) == 2
    for m in steps:
        lo, mean, hi = (m[f"reward_model/score/{k}"] for k in ("min", "mean", "max"))
        assert lo <= mean <= hi and lo < hi  # a random RM scores different samples apart
        rule = m["reward/test_e2e_reward_model:digit_share/mean"]
        assert m["critic/score/mean"] == pytest.approx(rule + WEIGHT * mean, abs=1e-6)
        assert m["timing_s/reward_model"] > 0


def _two_rank_step(
    rank: int, world_size: int, assets: Path, rm: Path, runs: Path, extra: dict[str, Any]
) -> dict[str, Any]:
    extra = {"trainer.total_training_steps": 1, "rollout.adaptive_tp.enable": "false", **extra}
    config = load_config(None, rm_overrides(assets, rm, runs, **extra))
    loop = SyncGRPO(
        config,
        World(rank, world_size, rank, torch.device("cpu")),
        str(assets / "model"),
        config.data.train_files,
        None,
    )
    held = None if loop.learned is None else type(loop.learned.scorer).__name__
    history = loop.run().history
    return {"history": history, "scorer": held}


@pytest.mark.e2e
@pytest.mark.multirank
def test_sharded_reward_model_scores_as_the_replicated_one(tmp_path: Path) -> None:
    """2 ranks, one step: the replicated RM on each of two replicas' first ranks against the RM
    FSDP2-sharded over both ranks with one TP-2 replica, whose rank 1 holds no sample and still
    takes part in every forward (the same sampled tokens: the engine's are TP-invariant). The
    scorer with both ranks holding samples is test_trainer_reward_model's."""
    assets, rm = rm_job(tmp_path)
    runs: dict[str, list[dict[str, Any]]] = {}
    cases = {
        "replicated": {"reward_model.strategy": "replicated"},
        "fsdp_tp2": {"reward_model.strategy": "fsdp2", "rollout.tensor_model_parallel_size": 2},
    }
    for name, extra in cases.items():
        runs[name] = run_ranks(
            _two_rank_step, world_size=2, args=(assets, rm, tmp_path / name, extra), timeout_s=300
        )
    assert [r["scorer"] for r in runs["replicated"]] == ["RewardModelScorer"] * 2
    assert [r["scorer"] for r in runs["fsdp_tp2"]] == ["ShardedRewardModelScorer"] * 2

    def step(name: str) -> dict[str, float]:
        (row,) = [h for h in runs[name][0]["history"] if "critic/score/mean" in h]
        return row

    want, got = step("replicated"), step("fsdp_tp2")
    for key in ("mean", "max", "min"):
        assert got[f"reward_model/score/{key}"] == pytest.approx(
            want[f"reward_model/score/{key}"], abs=1e-5
        ), key
    assert got["critic/score/mean"] == pytest.approx(want["critic/score/mean"], abs=1e-5)
