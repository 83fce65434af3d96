"""GRPO end to end on one rank with a learned reward model: the RM (with its own chat
template, so samples are re-encoded) scores every training sample, its weighted score joins
the rule reward, and reward_model/score/* is logged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator.config import load_config
from patrl.orchestrator.demo.tokenizer import build_tokenizer
from patrl.orchestrator.distributed import World
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl_testkit.jobs import addition_job
from patrl_testkit.models import save_tiny_reward_model

WEIGHT = 0.5


def digit_share(response: str, answer: str, **meta: Any) -> float:
    return sum(c.isdigit() for c in response) / max(1, len(response))


def test_grpo_with_a_reward_model_logs_its_scores(tmp_path: Path) -> None:
    assets = addition_job(tmp_path / "job")
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    rm = save_tiny_reward_model(tmp_path / "rm", tok, seed=1)
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
        "trainer.default_local_dir": tmp_path / "runs",
    }
    config = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
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
