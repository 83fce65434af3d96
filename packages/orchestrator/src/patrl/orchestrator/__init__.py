"""patrl.orchestrator: the RL loops users run: config, data, rewards, advantages, the GRPO loop.

Names are resolved on first use (PEP 562): reward worker processes import this package and
should not pay for torch, transformers and the engine they never use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "JobConfig": "config",
    "ConfigError": "config",
    "load_config": "config",
    "dump_config": "config",
    "PromptDataset": "data",
    "PromptItem": "data",
    "PromptLoader": "data",
    "load_prompt_dataset": "data",
    "RewardManager": "rewards",
    "RewardResult": "rewards",
    "RewardError": "rewards",
    "math_verify_reward": "rewards",
    "format_reward": "rewards",
    "resolve_reward_fn": "rewards",
    "compute_advantages": "advantages",
    "grpo_advantages": "advantages",
    "dr_grpo_advantages": "advantages",
    "rloo_advantages": "advantages",
    "per_token": "advantages",
    "filter_zero_variance_groups": "advantages",
    "refill": "advantages",
    "SyncSchedule": "sync_loop",
    "SyncGRPO": "sync_loop",
    "main": "main",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'patrl.orchestrator' has no attribute {name!r}")
    return getattr(importlib.import_module(f"patrl.orchestrator.{module}"), name)
