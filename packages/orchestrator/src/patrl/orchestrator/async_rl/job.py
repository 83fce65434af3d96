"""What both roles of an async job share: the config, the world split, the prompt stream, the
control plane and the weight store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.control import ControlPlane
from patrl.orchestrator.data import PromptDataset, PromptLoader
from patrl.orchestrator.distributed import World
from patrl.orchestrator.weight_store import WeightStore


@dataclass(slots=True)
class AsyncJob:
    """Ranks [0, R) generate, ranks [R, W) train (R = async_rl.rollout_ranks); they meet only
    through `control` (small values) and `weights` (published versions)."""

    config: JobConfig
    world: World
    model_dir: str
    run_dir: Path
    loader: PromptLoader
    val_set: PromptDataset | None  # only when the run validates (run.validates_ever)
    control: ControlPlane
    weights: WeightStore

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(self.config.async_rl.rollout_ranks))

    @property
    def trainer_ranks(self) -> list[int]:
        return list(range(self.config.async_rl.rollout_ranks, self.world.size))

    @property
    def num_rollout(self) -> int:
        return self.config.async_rl.rollout_ranks
