"""A learned reward model in the job: `reward_model.*` -> scores of the policy's samples.

Each scoring rank (the first of each TP group, as for the rule rewards) holds the whole RM and
scores its own replica's samples; the samples are re-encoded with the RM's tokenizer and chat
template when they differ from the policy's. The weighted score is added to the rule rewards
(rewards.add_model_scores). See docs/reward_models.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem
from patrl.trainer.reward_model import (
    RewardModelEncoder,
    RewardModelScorer,
    check_reward_model_dir,
)


class LearnedReward:
    """The job's reward model on `device`, with the encoder from the policy's tokenizer."""

    def __init__(self, config: JobConfig, policy_tokenizer: Any, device: torch.device) -> None:
        rm = config.reward_model
        assert rm.model.path is not None  # RewardModelConfig checks it when enabled
        self.weight = rm.weight
        self.scorer = RewardModelScorer(
            rm.model.path, device, rm_dtype(rm.dtype, device), rm.micro_batch_size
        )
        self.encoder = RewardModelEncoder(policy_tokenizer, self.scorer.tokenizer)

    def score(
        self, samples: Sequence[tuple[PromptItem, Sequence[int]]]
    ) -> tuple[list[float], float]:
        """(the RM score of each (prompt, response ids), the seconds it took)."""
        start = time.perf_counter()
        ids = [
            self.encoder.encode(item.prompt_token_ids, resp, item.messages)
            for item, resp in samples
        ]
        scores = self.scorer.score(ids).tolist() if ids else []
        return scores, time.perf_counter() - start


def rm_dtype(name: str, device: torch.device) -> torch.dtype:
    """`reward_model.dtype` on `device` ("auto": bfloat16 on CUDA, else float32)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def build_learned_reward(
    config: JobConfig, policy_tokenizer: Any, device: torch.device
) -> LearnedReward | None:
    """The job's reward model, or None when `reward_model.enable` is off."""
    if not config.reward_model.enable:
        return None
    return LearnedReward(config, policy_tokenizer, device)


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
