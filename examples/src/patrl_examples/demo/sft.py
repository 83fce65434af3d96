"""Warm-start the demo model by supervised fine-tuning on gold solutions (plain torch).

A share of the demonstrations (`direct_fraction`) box the total without the worked lines, so
the warm start answers many prompts that way though its worked lines are more often right: RL
has to learn which way pays. Training runs long enough for the worked lines to be learned past
three numbers, or writing them would pay too little for a short RL run to find.

Problems are drawn fresh for every batch, so there is nothing to overfit. Batches are cut by a
padded-token budget from length-sorted pools, so long-tailed lengths waste little on padding.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from patrl_examples.demo.task import Problem, TaskConfig, iter_problems
from patrl_examples.demo.tokenizer import prompt_text

IGNORE = -100


class SFTConfig(BaseModel):
    """The warm-start recipe. Part of the cache key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(2000, gt=0)
    direct_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="share of demonstrations that box the total without the running sums",
    )
    tokens_per_batch: int = Field(2048, gt=0, description="padded tokens per optimizer step")
    pool_size: int = Field(512, gt=0, description="problems sorted together by length")
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(30, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)


def encode_example(
    problem: Problem, tokenizer: PreTrainedTokenizerBase, direct: bool = False
) -> tuple[list[int], int]:
    """Token ids of the whole chat and the length of its prompt part (not trained on)."""
    prompt = prompt_text(tokenizer, problem.prompt)
    solution = problem.direct_solution() if direct else problem.solution()
    full = prompt + solution + tokenizer.eos_token
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(full, add_special_tokens=False)
    return ids, len(prompt_ids)


def iter_batches(
    stream: Iterator[Problem],
    tokenizer: PreTrainedTokenizerBase,
    config: SFTConfig,
    rng: random.Random,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) padded batches of about `tokens_per_batch` padded tokens."""
    while True:
        pool = [
            encode_example(next(stream), tokenizer, rng.random() < config.direct_fraction)
            for _ in range(config.pool_size)
        ]
        pool.sort(key=lambda ex: len(ex[0]))
        batches: list[list[tuple[list[int], int]]] = []
        current: list[tuple[list[int], int]] = []
        for ex in pool:
            if current and len(ex[0]) * (len(current) + 1) > config.tokens_per_batch:
                batches.append(current)
                current = []
            current.append(ex)
        batches.append(current)
        rng.shuffle(batches)
        for batch in batches:
            yield collate(batch, tokenizer.pad_token_id)


def collate(batch: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
    return input_ids, labels


def lr_at(step: int, config: SFTConfig) -> float:
    """Linear warmup, then cosine to a tenth of the peak."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: TaskConfig,
    config: SFTConfig,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> list[float]:
    """Train in place; returns the loss of every step."""
    torch.manual_seed(seed)
    batches = iter_batches(iter_problems(seed, task), tokenizer, config, random.Random(seed))
    return fit(model, batches, config, log)


def fit(
    model: PreTrainedModel,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    config: SFTConfig,
    log: Callable[[str], None] | None = None,
    label: str = "sft",
) -> list[float]:
    """`config.steps` AdamW steps on `batches` (input ids, labels; pads only after the last
    label) at `lr_at`'s schedule with `config`'s weight decay and gradient clip, in place;
    the loss of every step. The plain and the tool warm starts both train through it."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98)
    )
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        input_ids, labels = next(batches)
        # Pads sit only after the last label, so causal attention never lets a real token
        # see one: no attention mask is needed.
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if log is not None and (step % 25 == 0 or step == config.steps - 1):
            log(
                f"{label} step {step + 1}/{config.steps} loss {losses[-1]:.4f} "
                f"({time.perf_counter() - start:.0f}s)"
            )
    model.eval()
    return losses
