"""patrl.trainer.reward_model: learned reward models, scored and trained.

`RewardModelScorer` scores token sequences with an HF sequence-classification RM (one label,
the last non-pad token), `ShardedRewardModelScorer` the same with the RM FSDP2-sharded; `RewardModelEncoder` turns policy samples into the RM's tokens;
`BradleyTerryTrainer` trains one on preference pairs (FSDP2) and writes an HF directory. The
CLI (see docs/reward_models.md):

    python -m patrl.trainer.reward_model --model <causal-LM or RM dir> --train-files prefs.jsonl \
        --output rm/ [--val-files held.jsonl | --val-fraction 0.1] [--epochs 1 --lr 1e-5 ...]
"""

from patrl.trainer.reward_model.bradley_terry import BradleyTerryTrainer, load_classifier
from patrl.trainer.reward_model.checks import check_reward_model_dir, load_tokenizer
from patrl.trainer.reward_model.encode import RewardModelEncoder, same_tokenizer
from patrl.trainer.reward_model.preferences import (
    PreferenceKeys,
    read_preferences,
    tokenize_pairs,
)
from patrl.trainer.reward_model.scorer import RewardModelScorer, ShardedRewardModelScorer

__all__ = [
    "BradleyTerryTrainer",
    "PreferenceKeys",
    "RewardModelEncoder",
    "RewardModelScorer",
    "ShardedRewardModelScorer",
    "check_reward_model_dir",
    "load_classifier",
    "load_tokenizer",
    "read_preferences",
    "same_tokenizer",
    "tokenize_pairs",
]
