"""Partial rollouts through the real GRPO loop: unfinished groups are buffered, resumed first
at the next step, saved in checkpoints and restored on resume (a resumed run equals the
uninterrupted one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_e2e_grpo import KEYS, make_loop

from patrl.orchestrator import run_checkpoint
from patrl.orchestrator.distributed import World
from patrl.orchestrator.sync_loop import PARTIALS_FILE
from patrl_testkit.jobs import addition_job


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The e2e task with a model that ends its responses at uneven lengths: the logits are
    zero except EOS's, which swings with the hidden state."""
    from transformers import LlamaForCausalLM

    root = addition_job(tmp_path_factory.mktemp("e2e_partial"))
    model = LlamaForCausalLM.from_pretrained(root / "model")
    torch.manual_seed(1)
    with torch.no_grad():
        head = model.lm_head.weight
        head.zero_()
        head[model.config.eos_token_id] = torch.randn(head.shape[1]) * 0.6
    model.save_pretrained(root / "model")
    return root


PARTIAL = {
    "rollout.over_sample_rate": 0.5,
    "data.train_batch_size": 4,
    "actor.ppo_mini_batch_size": 4,
    "rollout.n": 2,
    "data.max_response_length": 48,
    "actor.optim.lr": 1e-6,  # the lengths, not the learning, are under test
    "trainer.test_freq": 0,
    "trainer.val_before_train": "false",
}


def _history(loop: Any) -> list[dict[str, float]]:
    return [h for h in loop.run().history if "critic/score/mean" in h]


@pytest.mark.e2e
def test_partial_rollouts_buffer_resume_and_checkpoint(assets: Path, tmp_path: Path) -> None:
    world = World(0, 1, 0, torch.device("cpu"))
    straight = _history(
        make_loop(assets, tmp_path / "a", world, **PARTIAL, **{"trainer.total_training_steps": 4})
    )
    assert len(straight) == 4, straight
    assert all(h["partial/finished_groups"] >= 4 for h in straight)
    assert any(h["partial/buffered_groups"] > 0 for h in straight[:-1])
    assert any(h["partial/resumed_groups"] > 0 for h in straight[1:])
    assert any(h["partial/off_policy_token_frac"] > 0 for h in straight[1:])

    first = make_loop(assets, tmp_path / "b", world, **PARTIAL, **{"trainer.save_freq": 2})
    first.run()
    saved = run_checkpoint.step_dir(tmp_path / "b", 2) / PARTIALS_FILE
    assert saved.is_file()
    buffered = sorted(first.partials)
    resumed = make_loop(
        assets, tmp_path / "b", world, **PARTIAL, **{"trainer.total_training_steps": 4}
    )
    resumed.resume()
    assert sorted(resumed.partials) == buffered
    tail = _history(resumed)

    def rows(history: list[dict[str, float]]) -> list[list[float]]:
        return [[h[k] for k in KEYS] for h in history if h["step"] > 2]

    torch.testing.assert_close(
        torch.tensor(rows(tail)), torch.tensor(rows(straight)), rtol=1e-5, atol=1e-6
    )
