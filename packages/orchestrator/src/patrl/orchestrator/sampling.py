"""How a step's prompts are sampled: each prompt's `SamplingParams` (its seed from a seed key
and the prompt only, so a resumed run or the other schedule samples the same tokens), the seed
keys of training rounds, validation and ReMax's greedy baselines, and the validation batches."""

from __future__ import annotations

from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptDataset, PromptItem
from patrl.rollout import SamplingParams


def sampling_params(
    config: JobConfig,
    item: PromptItem,
    n: int,
    temperature: float,
    seed_key: tuple[int, ...],
    validation: bool = False,
) -> SamplingParams:
    """How `item` is sampled (top-p/top-k of `rollout`, or of `rollout.val_kwargs` for a
    `validation`); the seed depends on `seed_key` and the prompt only, so a resumed run, or the
    other schedule, samples the same tokens."""
    s = config.rollout.val_kwargs if validation else config.rollout
    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=s.top_p if temperature > 0 else 1.0,
        top_k=s.top_k if temperature > 0 and s.top_k > 0 else 0,  # verl's -1 (and 0): off
        max_tokens=config.data.max_response_length,
        # Python's hash of a tuple of ints is the same in every process and run.
        seed=hash((*seed_key, item.index)) & 0x7FFF_FFFF_FFFF,
    )


def training_seed_key(config: JobConfig, step: int, round_: int = 1) -> tuple[int, ...]:
    """The seed key of step `step`'s prompts in generation round `round_`."""
    return (config.trainer.seed, step, round_)


VALIDATION_SEED_KEY = (-1,)

GREEDY_BASELINE_SEED_KEY = (-2,)  # remax's greedy responses (the seed is unused at temperature 0)


def validation_batches(config: JobConfig, val_set: PromptDataset) -> list[list[PromptItem]]:
    """Every validation prompt, in order, in batches of `data.val_batch_size` (verl's
    validation dataloader; None: one batch of all)."""
    items = list(val_set.items)
    size = config.data.val_batch_size or len(items)
    return [items[i : i + size] for i in range(0, len(items), size)]
