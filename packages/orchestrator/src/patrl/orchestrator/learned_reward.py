"""A learned reward model in the job: `reward_model.*` -> scores of the policy's samples.

Placement (`reward_model.strategy`, resolved by `rm_placement`): replicated, each scoring rank
(the first of each TP group, as for the rule rewards) holding the whole RM and scoring its own
replica's samples; or FSDP2-sharded over the world, every rank taking part in each scoring
(the scoring ranks' samples are gathered, every rank scores an equal share, each scoring rank
keeps its own scores). The samples are re-encoded with the RM's tokenizer and chat template
when they differ from the policy's. The weighted score is added to the rule rewards
(rewards.add_model_scores). See docs/reward_models.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.distributed import World, all_gather_objects, broadcast_object
from patrl.trainer.reward_model import (
    RewardModelEncoder,
    RewardModelScorer,
    ShardedRewardModelScorer,
    check_reward_model_dir,
)

Placement = Literal["replicated", "fsdp"]
# auto shards an RM whose weights take more than this share of one GPU's memory: beside the
# engine (rollout.gpu_memory_utilization) and the trainer there is little more to spare.
AUTO_SHARD_FRACTION = 0.1


class LearnedReward:
    """The job's reward model on `world.device`, with the encoder from the policy's tokenizer.
    `mesh` (a 1-D mesh over the world) makes it FSDP2-sharded: `score` is then a collective
    that every rank calls, ranks without samples with none (`collective`)."""

    def __init__(
        self, config: JobConfig, policy_tokenizer: Any, world: World, mesh: Any = None
    ) -> None:
        rm = config.reward_model
        assert rm.model.path is not None  # RewardModelConfig checks it when enabled
        self.weight = rm.weight
        self.world = world
        dtype = rm_dtype(rm.dtype, world.device)
        self.scorer: RewardModelScorer | ShardedRewardModelScorer
        if mesh is None:
            self.scorer = RewardModelScorer(rm.model.path, world.device, dtype, rm.micro_batch_size)
        else:
            self.scorer = ShardedRewardModelScorer(
                rm.model.path, mesh, world.device, dtype, rm.micro_batch_size
            )
        self.encoder = RewardModelEncoder(policy_tokenizer, self.scorer.tokenizer)

    @property
    def collective(self) -> bool:
        """Whether `score` is a collective over the world (the sharded placement)."""
        return isinstance(self.scorer, ShardedRewardModelScorer)

    def score(
        self, samples: Sequence[tuple[PromptItem, Sequence[int]]]
    ) -> tuple[list[float], float]:
        """(the RM score of each (prompt, response ids), the seconds it took). Sharded: every
        rank calls it with its own samples (possibly none) and gets their scores."""
        start = time.perf_counter()
        ids = [
            self.encoder.encode(item.prompt_token_ids, resp, item.messages)
            for item, resp in samples
        ]
        if not self.collective:
            scores = self.scorer.score(ids).tolist() if ids else []
            return scores, time.perf_counter() - start
        shares = all_gather_objects(self.world, ids)
        every = self.scorer.score([s for share in shares for s in share]).tolist()
        offset = sum(len(share) for share in shares[: self.world.rank])
        return every[offset : offset + len(ids)], time.perf_counter() - start


def rm_dtype(name: str, device: torch.device) -> torch.dtype:
    """`reward_model.dtype` on `device` ("auto": bfloat16 on CUDA, else float32)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def rm_placement(config: JobConfig, world: World) -> tuple[Placement, str]:
    """Where the RM lives and why: `reward_model.strategy`, with "auto" sharding on CUDA when
    the RM's weights (in `reward_model.dtype`) exceed AUTO_SHARD_FRACTION of the device's
    memory. One process has nothing to shard over."""
    rm = config.reward_model
    if not world.distributed:
        return "replicated", "one process"
    if rm.strategy in ("fsdp", "fsdp2"):
        return "fsdp", f"reward_model.strategy={rm.strategy}"
    if rm.strategy == "replicated":
        return "replicated", "reward_model.strategy=replicated"
    if world.device.type != "cuda":
        return "replicated", "strategy auto off CUDA"
    assert rm.model.path is not None
    weights = rm_weight_bytes(rm.model.path, rm_dtype(rm.dtype, world.device))
    total = torch.cuda.get_device_properties(world.device).total_memory
    share = weights / total
    why = f"strategy auto: its weights are {share:.0%} of the GPU's memory"
    return ("fsdp" if share > AUTO_SHARD_FRACTION else "replicated"), why


def rm_weight_bytes(path: str, dtype: torch.dtype) -> int:
    """The RM's parameter bytes in `dtype`, read from its safetensors headers (no load)."""
    from safetensors import safe_open

    numel = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = f.get_slice(name).get_shape()
                numel += int(torch.Size(shape).numel())
    return numel * torch.empty(0, dtype=dtype).element_size()


def build_learned_reward(
    config: JobConfig, policy_tokenizer: Any, world: World, scores: bool, mesh: Any = None
) -> LearnedReward | None:
    """This rank's reward model, or None: when `reward_model.enable` is off, or when the RM is
    replicated and this rank does not score (`scores`). Sharded, every rank holds a share over
    `mesh` (the world's 1-D mesh). Every rank must call it (the placement is agreed on)."""
    if not config.reward_model.enable:
        return None
    placement, why = broadcast_object(
        world, rm_placement(config, world) if world.is_first else None
    )
    if world.is_first:
        where = f"FSDP2-sharded over {world.size} ranks" if placement == "fsdp" else "replicated"
        print(f"reward model {config.reward_model.model.path}: {where} ({why})")
    if placement == "fsdp":
        return LearnedReward(config, policy_tokenizer, world, mesh)
    return LearnedReward(config, policy_tokenizer, world) if scores else None


def reward_model_problems(config: JobConfig) -> list[str]:
    """What is wrong with the configured reward-model directory (preflight), each named."""
    rm = config.reward_model
    if not rm.enable or rm.model.path is None:
        return []
    try:
        check_reward_model_dir(rm.model.path)
    except (ValueError, OSError) as err:
        return [str(err)]
    return []
