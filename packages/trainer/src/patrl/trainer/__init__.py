"""patrl.trainer: FSDP2 policy trainer, RL losses, logprobs, weight export, checkpoints."""

from patrl.trainer.config import CriticConfig, OptimConfig, TrainerConfig
from patrl.trainer.critic import Critic
from patrl.trainer.gae import gae
from patrl.trainer.logprobs import effective_temperature, logprobs_and_entropy, token_logprobs
from patrl.trainer.losses import (
    PolicyLossStats,
    ValueLossStats,
    aggregate,
    kl_penalty,
    masked_mean,
    policy_loss,
    value_loss,
)
from patrl.trainer.micro_batches import (
    bin_by_token_budget,
    padded_fraction,
    plan_micro_batches,
    split_across_ranks,
)
from patrl.trainer.policy_batch import PolicyBatch
from patrl.trainer.trainer import NonFiniteError, Trainer
from patrl.trainer.weights import iter_full_weights

__all__ = [
    "Critic",
    "CriticConfig",
    "NonFiniteError",
    "OptimConfig",
    "PolicyBatch",
    "PolicyLossStats",
    "Trainer",
    "TrainerConfig",
    "ValueLossStats",
    "aggregate",
    "bin_by_token_budget",
    "effective_temperature",
    "gae",
    "iter_full_weights",
    "kl_penalty",
    "logprobs_and_entropy",
    "masked_mean",
    "padded_fraction",
    "plan_micro_batches",
    "policy_loss",
    "split_across_ranks",
    "token_logprobs",
    "value_loss",
]
