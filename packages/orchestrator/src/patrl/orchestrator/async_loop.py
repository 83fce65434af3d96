"""The asynchronous schedule (GRPO, PPO/GAE, RLOO, ...) with bounded staleness (AReaL): generation never waits for a
full step.

Ranks [0, R) only generate (R = async_rl.rollout_ranks, each its own tp=1 engine), ranks
[R, W) only train; they meet through the job's store and run directory, never in a collective.
Tickets are admitted while they stay within async_rl.max_staleness versions of the rollout
rank's weights and are trained in ticket order; lost rollout ranks' tickets migrate to peers.
The design: docs/async.md. The parts: `patrl.orchestrator.async_rl`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from patrl.orchestrator.async_rl.job import AsyncJob
from patrl.orchestrator.async_rl.rollout_worker import RolloutWorker
from patrl.orchestrator.async_rl.trainer_worker import TrainerWorker
from patrl.orchestrator.build import load_data, seed_everything
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.control import ControlPlane
from patrl.orchestrator.distributed import World
from patrl.orchestrator.run import RunResult, validates_ever
from patrl.orchestrator.support import check_supported
from patrl.orchestrator.weight_store import WeightStore


class AsyncSchedule:
    """The job's entry: builds this rank's role and runs it: a trainer rank's
    `TrainerWorker` through `run.RunLoop`, a rollout rank's `RolloutWorker` loop."""

    def __init__(
        self,
        config: JobConfig,
        world: World,
        model_dir: str,
        train_files: Any,
        val_files: Any,
        peer_timeout_s: float | None = None,
    ) -> None:
        """`peer_timeout_s`: None = async_rl.peer_timeout_s."""
        check_supported(config, world.size)
        # Async rollout replicas are static tp=1 engines: adaptive TP needs collectives over
        # the rollout ranks, which async mode avoids.
        config = config.model_copy(deep=True)
        config.rollout.adaptive_tp.enable = False
        seed_everything(config.trainer.seed)
        data = load_data(
            config, model_dir, train_files, val_files if validates_ever(config) else None
        )
        config = data.config
        timeout = config.async_rl.peer_timeout_s if peer_timeout_s is None else peer_timeout_s
        self.job = AsyncJob(
            config,
            world,
            model_dir,
            config.run_dir,
            data.loader,
            data.val_set,
            ControlPlane.of_default_group(world.rank, timeout),
            WeightStore(config.run_dir / "weights"),
        )
        # new_group is collective over the world: every rank makes the trainers' group.
        trainer_group = dist.new_group(self.job.trainer_ranks)
        self.role: RolloutWorker | TrainerWorker
        if world.rank < self.job.num_rollout:
            self.role = RolloutWorker(self.job)
        else:
            self.role = TrainerWorker(self.job, trainer_group)

    def run(self) -> RunResult:
        try:
            return self.role.run()
        except BaseException as err:
            # Peers polling the store stop at once instead of after their timeout.
            self.job.control.fail(f"{type(err).__name__}: {err}"[:500])
            raise


AsyncGRPO = AsyncSchedule  # the name it had while it ran GRPO only
