"""The async schedule's checkpoints carry the speculation history: the trainer keeps every
trained group's complete responses (all rollout ranks'), saves them beside its other files, and
a resumed run's rollout ranks draft from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator import run_checkpoint
from patrl.orchestrator.async_loop import AsyncGRPO
from patrl.orchestrator.async_rl.rollout_worker import RolloutWorker
from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.drafter_checkpoint import DRAFTER_FILE
from patrl_testkit.jobs import addition_job, tiny_job_overrides
from patrl_testkit.multirank import run_ranks

SPEC = {
    "trainer.mode": "async",
    "async_rl.rollout_ranks": 1,
    "async_rl.max_staleness": 0,
    "rollout.speculative.enable": "true",
    "rollout.speculative.max_num_seqs": 0,
    "trainer.test_freq": 0,
    "trainer.val_before_train": "false",
    "trainer.save_freq": 1,
}


def _run(rank: int, world_size: int, assets: Path, run_dir: Path, steps: int) -> dict[str, Any]:
    """One async run to `steps` (resuming from run_dir's newest checkpoint); the rollout rank
    returns its drafter's history at the end."""
    world = World(rank, world_size, rank, torch.device("cpu"))
    overrides = tiny_job_overrides(
        assets, run_dir, **SPEC, **{"trainer.total_training_steps": steps}
    )
    config = load_config(None, overrides)
    loop = AsyncGRPO(config, world, str(assets / "model"), config.data.train_files, None, 120)
    loop.run()
    if not isinstance(loop.role, RolloutWorker):
        return {"role": "trainer"}
    drafter = loop.role.engine.drafter
    assert drafter is not None
    return {"role": "rollout", "end": drafter.state_dict()}


def by_prompt(state: dict[str, Any]) -> dict[tuple[int, ...], list[list[int]]]:
    return {tuple(key): sorted(responses) for key, responses in state["history"]}


@pytest.mark.e2e
@pytest.mark.multirank
def test_a_resumed_async_run_drafts_from_the_trained_groups_history(tmp_path: Path) -> None:
    assets = addition_job(tmp_path / "assets")
    run_dir = tmp_path / "run"
    first = run_ranks(_run, world_size=2, args=(assets, run_dir, 1), timeout_s=300)
    saved = torch.load(run_checkpoint.step_dir(run_dir, 1) / DRAFTER_FILE, weights_only=True)
    # 4 prompts of 2 samples trained in step 1, each remembered under its prompt's tokens
    assert len(saved["history"]) == 4
    assert all(len(responses) == 2 for _, responses in saved["history"])
    # the rollout rank's own history (its requests' responses) is what the trainer kept, each
    # prompt's in sample order there, in the order they finished here
    assert by_prompt(first[0]["end"]) == by_prompt(saved)
    resumed = run_ranks(_run, world_size=2, args=(assets, run_dir, 2), timeout_s=300)
    # step 2 samples other prompts: step 1's are in the resumed rank's history only because
    # it restored them
    end = by_prompt(resumed[0]["end"])
    assert len(end) == 8
    assert all(end[key] == responses for key, responses in by_prompt(saved).items())
