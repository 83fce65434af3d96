"""Speculation through the real GRPO loop: the drafter's history is saved in each checkpoint
and restored on resume, and the speculation metrics are logged each step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_e2e_grpo import make_loop

from patrl.orchestrator import run_checkpoint
from patrl.orchestrator.distributed import World
from patrl.orchestrator.drafter_checkpoint import DRAFTER_FILE
from patrl_testkit.jobs import addition_job

SPEC = {
    "rollout.speculative.enable": "true",
    "rollout.speculative.max_num_seqs": 0,
    "rollout.adaptive_tp.enable": "false",  # no latency profile to measure
    "trainer.test_freq": 0,
    "trainer.val_before_train": "false",
    "trainer.save_freq": 2,
}


@pytest.mark.e2e
def test_a_resumed_run_keeps_the_drafters_history(tmp_path: Path) -> None:
    assets = addition_job(tmp_path / "assets")
    world = World(0, 1, 0, torch.device("cpu"))
    first = make_loop(assets, tmp_path / "run", world, **SPEC)
    history = first.run().history
    steps = [h for h in history if "critic/score/mean" in h]
    assert steps and all("rollout/spec_acceptance" in h for h in steps)
    assert all("rollout/spec_accepted_share/history" in h for h in steps)
    assert (run_checkpoint.step_dir(tmp_path / "run", 2) / DRAFTER_FILE).is_file()
    assert first.engine.drafter is not None
    kept = first.engine.drafter.state_dict()
    assert kept["history"]

    resumed = make_loop(
        assets, tmp_path / "run", world, **SPEC, **{"trainer.total_training_steps": 3}
    )
    resumed.resume()
    assert resumed.step == 2
    assert resumed.engine.drafter is not None
    assert resumed.engine.drafter.state_dict() == kept


@pytest.mark.e2e
def test_partial_rollouts_log_the_speculation_metrics(tmp_path: Path) -> None:
    """The partial-rollout path (rollout.over_sample_rate > 0) logs what the plain one does."""
    assets = addition_job(tmp_path / "assets")
    world = World(0, 1, 0, torch.device("cpu"))
    extra = {"rollout.over_sample_rate": 0.5, "trainer.save_freq": -1}
    loop = make_loop(assets, tmp_path / "run", world, **{**SPEC, **extra})
    steps = [h for h in loop.run().history if "critic/score/mean" in h]
    assert steps and all("partial/finished_groups" in h for h in steps)
    assert all("rollout/spec_acceptance" in h for h in steps)
    assert all("rollout/spec_tokens_per_step" in h for h in steps)
