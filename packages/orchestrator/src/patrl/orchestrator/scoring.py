"""Scoring a step's responses: each completion becomes a `Sample` carrying its reward (the
reward functions, the reward model's weighted score, DAPO's overlong penalty), with the reward
metrics and what failed; replicas' reward metrics are merged here too."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.errors import JobError
from patrl.orchestrator.learned_reward import LearnedReward
from patrl.orchestrator.rewards import (
    FailureSummary,
    OverlongBuffer,
    RewardManager,
    add_model_scores,
    add_overlong_penalty,
)
from patrl.rollout import RequestOutput


@dataclass(slots=True)
class Sample:
    """One scored response, as gathered on every rank."""

    prompt_index: int  # PromptItem.index: the group id
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    reward: float
    request_id: str = ""
    baseline: float = 0.0  # remax: the reward of its prompt's greedy response
    overlong: float = 0.0  # DAPO's overlong penalty, included in `reward`
    # multi-turn: 1 where token_ids[i] was sampled by the engine, 0 on appended tool tokens
    # (whose logprobs are 0.0); None: every token is the model's
    response_mask: list[int] | None = None
    # the numeric entries its reward functions returned beside their scores ("function/key";
    # absent where a function returned none): validation's per-variable metrics
    extras: dict[str, float] = field(default_factory=dict)

    @property
    def model_tokens(self) -> int:
        """How many of `token_ids` the model sampled (the trained ones)."""
        return len(self.token_ids) if self.response_mask is None else sum(self.response_mask)


def model_token_mask(sample: Sample) -> np.ndarray:
    """Which of the sample's response tokens the model sampled (bool, one per token): all of
    them, but a multi-turn sample's appended tool tokens."""
    if sample.response_mask is None:
        return np.ones(len(sample.token_ids), dtype=bool)
    return np.asarray(sample.response_mask, dtype=bool)


@dataclass(slots=True)
class Trajectory:
    """One multi-turn sample as `score_outputs` reads it (a CompletionOutput's fields, plus
    `response_mask`): `token_ids` are the model's and the appended tool tokens in order,
    `text` their decoding (what the reward sees), `logprobs` 0.0 on tool tokens;
    `turn_scores`, an interaction's per-turn scores (None: the sample had no interaction),
    which the reward functions read as verl passes them (`extra_info["turn_scores"]`)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    response_mask: list[int]
    turn_scores: list[float] | None = None


@dataclass(slots=True)
class TrajectoryOutput:
    """A prompt's multi-turn samples (a RequestOutput's fields): `prompt_token_ids` are the
    agent loop's rendering of the prompt (with the tools' schemas), the trained prompt."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Trajectory] = field(default_factory=list)
    error: str | None = None


def overlong_buffer(config: JobConfig) -> OverlongBuffer | None:
    """`reward_model.overlong_buffer` as the scorer applies it (None: off)."""
    ob = config.reward_model.overlong_buffer
    if not ob.enable:
        return None
    return OverlongBuffer(ob.len, ob.penalty_factor, config.data.max_response_length, ob.log)


def filter_value(config: JobConfig, sample: Sample) -> float:
    """What DAPO's dynamic sampling compares within a group (`algorithm.filter_groups.metric`):
    acc/score, the score before the overlong penalty (verl's reward_extra_info "acc"); else
    the reward trained on."""
    if config.algorithm.filter_groups.metric in ("acc", "score"):
        return sample.reward - sample.overlong
    return sample.reward


def score_outputs(
    rewards: RewardManager,
    local: Sequence[tuple[PromptItem, RequestOutput | TrajectoryOutput]],
    learned: LearnedReward | None = None,
    overlong: OverlongBuffer | None = None,
) -> tuple[list[Sample], dict[str, float], FailureSummary]:
    """Every completion of `local` scored by the reward functions (plus the reward model's
    weighted score, when `learned`; plus DAPO's overlong penalty, when `overlong`), the reward
    metrics and what failed. A sharded `learned` is a collective: it is called even with
    nothing to score. A `TrajectoryOutput`'s samples keep its prompt ids and their masks."""
    if not local:
        if learned is not None and learned.collective:
            learned.score([])
        return [], {}, FailureSummary()
    check_not_rejected(local)
    flat = [(item, out, c) for item, out in local for c in out.outputs]
    result = rewards.score(
        [c.text if c.text is not None else "" for _, _, c in flat],
        [item.answer for item, _, _ in flat],
        [reward_meta(item, c) for item, _, c in flat],
    )
    if learned is not None:
        scores, seconds = learned.score([(item, c.token_ids) for item, _, c in flat])
        add_model_scores(result, scores, learned.weight, seconds)
    penalties = [0.0] * len(flat)
    if overlong is not None:
        penalties = add_overlong_penalty(result, [len(c.token_ids) for _, _, c in flat], overlong)
    samples = [
        Sample(
            item.index,
            out.prompt_token_ids if isinstance(out, TrajectoryOutput) else item.prompt_token_ids,
            c.token_ids,
            c.logprobs,
            c.finish_reason,
            reward,
            out.request_id,
            overlong=penalty,
            response_mask=c.response_mask if isinstance(c, Trajectory) else None,
            extras={
                name: values[i]
                for name, values in result.extras.items()
                if not math.isnan(values[i])
            },
        )
        for i, ((item, out, c), reward, penalty) in enumerate(
            zip(flat, result.rewards, penalties, strict=True)
        )
    ]
    return samples, result.metrics(), FailureSummary.of(result)


def reward_meta(item: PromptItem, c: Any) -> dict[str, Any]:
    """The row fields a reward function of completion `c` sees: the row's, plus a
    multi-turn sample's interaction `turn_scores` in its `extra_info` (verl's) and at the top
    level."""
    meta = dict(item.extra)
    scores = c.turn_scores if isinstance(c, Trajectory) else None
    if scores is not None:
        info = meta.get("extra_info")
        meta["extra_info"] = {**(info if isinstance(info, dict) else {}), "turn_scores": scores}
        meta["turn_scores"] = list(scores)
    return meta


def check_not_rejected(
    local: Sequence[tuple[PromptItem, RequestOutput | TrajectoryOutput]],
) -> None:
    """Raise JobError (this rank's) with the engine's own reason when it refused to run a
    prompt: an empty response would fail far from its cause."""
    rejected = [(item, out) for item, out in local if out.error is not None]
    if rejected:
        item, out = rejected[0]
        raise JobError(
            f"the rollout engine rejected {len(rejected)} of {len(local)} prompts; the first, "
            f"row {item.index} ({len(item.prompt_token_ids)} tokens): {out.error}",
            collective=False,
        )


def merge_reward_metrics(into: dict[str, float], shares: list[dict[str, float]]) -> None:
    """Add up counters across replicas (and rounds); average means; max of maxima, min of
    minima; the slowest replica's time."""
    for key in {k for share in shares for k in share}:
        values = [share[key] for share in shares if key in share]
        if key.endswith("/mean"):
            into[key] = float(np.mean(values))
        elif key.endswith(("/max", "/min")):
            pick = max if key.endswith("/max") else min
            into[key] = pick([*values, into.get(key, values[0])])
        elif key.startswith("timing_s/"):
            into[key] = into.get(key, 0.0) + max(values)
        else:
            into[key] = into.get(key, 0.0) + sum(values)
