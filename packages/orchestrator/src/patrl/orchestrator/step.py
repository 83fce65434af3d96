"""The names of one step's pieces under the module that held them before they were split by
job: `sampling` (sampling parameters, seed keys), `scoring` (`Sample`, rewards), `update`
(advantages, the PPO epochs) and `step_metrics` (the metrics row). Import from those."""

from __future__ import annotations

from patrl.orchestrator.sampling import (
    GREEDY_BASELINE_SEED_KEY,
    VALIDATION_SEED_KEY,
    sampling_params,
    training_seed_key,
    validation_batches,
)
from patrl.orchestrator.scoring import (
    Sample,
    check_not_rejected,
    filter_value,
    merge_reward_metrics,
    overlong_buffer,
    score_outputs,
)
from patrl.orchestrator.step_metrics import (
    PolicyUpdate,
    batch_metrics,
    mismatch_metrics,
    probs_diff,
    step_metrics,
    timed,
    validation_metrics,
    value_metrics,
)
from patrl.orchestrator.update import (
    batch_rows,
    check_groups,
    correct_batch,
    critic_update,
    kl_penalized_rewards,
    mini_batches,
    policy_batch,
    ppo_update,
    prompts_per_mini_batch,
    score_old_and_ref,
    single_update,
    update_actor,
    update_policy,
    update_with_critic,
)

__all__ = [
    "GREEDY_BASELINE_SEED_KEY",
    "VALIDATION_SEED_KEY",
    "PolicyUpdate",
    "Sample",
    "batch_metrics",
    "batch_rows",
    "check_groups",
    "check_not_rejected",
    "correct_batch",
    "critic_update",
    "filter_value",
    "kl_penalized_rewards",
    "merge_reward_metrics",
    "mini_batches",
    "mismatch_metrics",
    "overlong_buffer",
    "policy_batch",
    "ppo_update",
    "probs_diff",
    "prompts_per_mini_batch",
    "sampling_params",
    "score_old_and_ref",
    "score_outputs",
    "single_update",
    "step_metrics",
    "timed",
    "training_seed_key",
    "update_actor",
    "update_policy",
    "update_with_critic",
    "validation_batches",
    "validation_metrics",
    "value_metrics",
]
