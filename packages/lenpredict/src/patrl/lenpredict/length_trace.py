"""Length traces: the response lengths of a run, on disk as JSONL, and synthetic ones.

Format (one JSON object per line, one line per sample):

    {"step": 3, "round": 0, "prompt_id": "17", "sample": 2, "prompt_tokens": 212,
     "response_tokens": 1834, "finish_reason": "stop"}

- `step`: the training step the sample was generated for. Optional, default 0.
- `round`: the generation round within the step (DAPO's dynamic sampling draws several);
  each (step, round) is one rollout, simulated on its own. Optional, default 0.
- `prompt_id`: identifies the prompt, the same across steps (what the length predictor learns
  from); the samples of a prompt in one rollout form its GRPO group.
- `sample`: index of the sample within its group (0..n-1), unique within the group.
- `prompt_tokens`, `response_tokens`: lengths in tokens (response >= 1); every sample of a
  group has its prompt's length.
- `finish_reason`: why the sample ended ("stop", "length" at max_tokens, ...). Optional;
  recorded, not simulated.
Unknown keys are rejected, so a typo does not silently change what is simulated. Runs write
this file as `<run_dir>/lengths.jsonl` (patrl.orchestrator.length_log).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class LengthRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int = Field(default=0, ge=0)
    round: int = Field(default=0, ge=0)
    prompt_id: str
    sample: int = Field(ge=0)
    prompt_tokens: int = Field(gt=0)
    response_tokens: int = Field(gt=0)
    finish_reason: str | None = None

    @property
    def rollout(self) -> tuple[int, int]:
        return (self.step, self.round)


@dataclass(frozen=True, slots=True)
class PromptGroup:
    """The n samples of one prompt in one rollout: what the simulator schedules."""

    prompt_id: str
    prompt_tokens: int
    response_tokens: tuple[int, ...]


def read_lengths(path: str | Path) -> list[LengthRecord]:
    """The records of a length log; a bad line, a group whose samples disagree on the prompt's
    length, or a sample index given twice raises a ValueError naming the file and line."""
    records: list[LengthRecord] = []
    prompts: dict[tuple[int, int, str], tuple[int, int]] = {}  # -> (prompt_tokens, first line)
    seen: dict[tuple[int, int, str, int], int] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = LengthRecord.model_validate_json(line)
        except ValueError as err:
            raise ValueError(f"{path}:{number}: not a length record: {err}") from err
        group = (record.step, record.round, record.prompt_id)
        tokens, first = prompts.setdefault(group, (record.prompt_tokens, number))
        if tokens != record.prompt_tokens:
            raise ValueError(
                f"{path}:{number}: prompt {record.prompt_id!r} of step {record.step} round "
                f"{record.round} has prompt_tokens={record.prompt_tokens}, but {tokens} at line "
                f"{first}; the samples of one prompt share its length"
            )
        key = (*group, record.sample)
        if key in seen:
            raise ValueError(
                f"{path}:{number}: sample {record.sample} of prompt {record.prompt_id!r} (step "
                f"{record.step} round {record.round}) also at line {seen[key]}"
            )
        seen[key] = number
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no length records")
    return records


def write_lengths(path: str | Path, records: list[LengthRecord]) -> None:
    Path(path).write_text("".join(r.model_dump_json() + "\n" for r in records))


def group_by_rollout(records: list[LengthRecord]) -> dict[tuple[int, int], list[PromptGroup]]:
    """Rollouts by (step, round), each a list of prompt groups in order of first appearance."""
    buckets: dict[tuple[int, int], dict[str, list[LengthRecord]]] = defaultdict(dict)
    for r in records:
        buckets[r.rollout].setdefault(r.prompt_id, []).append(r)
    result = {}
    for rollout, prompts in sorted(buckets.items()):
        groups = []
        for prompt_id, samples in prompts.items():
            prompt_lengths = {s.prompt_tokens for s in samples}
            if len(prompt_lengths) != 1:
                raise ValueError(
                    f"step {rollout[0]} round {rollout[1]} prompt {prompt_id!r} has "
                    f"prompt_tokens {sorted(prompt_lengths)}; the samples of one prompt must "
                    "share its length"
                )
            samples = sorted(samples, key=lambda s: s.sample)
            groups.append(
                PromptGroup(
                    prompt_id, samples[0].prompt_tokens, tuple(s.response_tokens for s in samples)
                )
            )
        result[rollout] = groups
    return result


def group_by_step(records: list[LengthRecord]) -> dict[int, list[PromptGroup]]:
    """Rollouts by step, for traces of one round a step (`group_by_rollout` otherwise)."""
    rollouts = group_by_rollout(records)
    several = sorted({step for step, round_ in rollouts if round_ > 0})
    if several:
        raise ValueError(
            f"steps {several[:5]} hold several generation rounds; group them with group_by_rollout"
        )
    return {step: groups for (step, _), groups in rollouts.items()}


@dataclass(frozen=True, slots=True)
class LongTailSpec:
    """A DeepScaleR-like response-length law, stated exactly (benchmarks/simulate_cluster.py
    says why these numbers). Per prompt p: prompt_tokens ~ U{64..512}, scale m_p =
    exp(N(ln median, prompt_sigma²)), failure rate f_p ~ U(0, max_failure_rate). Per sample:
    failed with probability f_p (failure_factor times longer); length = m_p · factor ·
    exp(N(0, sample_sigma²)), rounded, clipped to [16, max_length]; with probability
    runaway_rate (an ASSUMPTION, 0 by default, its own random stream) it runs to max_length."""

    median: float = 2000.0
    prompt_sigma: float = 0.5
    sample_sigma: float = 0.4
    max_failure_rate: float = 0.6
    failure_factor: float = 3.0
    max_length: int = 16384
    runaway_rate: float = 0.0


def long_tail_trace(
    spec: LongTailSpec,
    num_prompts: int,
    samples_per_prompt: int,
    steps: int = 1,
    seed: int = 0,
) -> list[LengthRecord]:
    """`steps` rollouts over the same `num_prompts` prompts (an epoch per step), so prompts
    recur the way they do across epochs of GRPO training."""
    rng = np.random.default_rng(seed)
    runaway = np.random.default_rng([seed, 1])
    prompt_tokens = rng.integers(64, 513, num_prompts)
    scale = np.exp(rng.normal(np.log(spec.median), spec.prompt_sigma, num_prompts))
    fail_rate = rng.uniform(0, spec.max_failure_rate, num_prompts)
    records = []
    for step in range(steps):
        for p in range(num_prompts):
            failed = rng.random(samples_per_prompt) < fail_rate[p]
            noise = np.exp(rng.normal(0, spec.sample_sigma, samples_per_prompt))
            lengths = scale[p] * np.where(failed, spec.failure_factor, 1.0) * noise
            lengths = np.clip(np.rint(lengths), 16, spec.max_length).astype(int)
            if spec.runaway_rate > 0:
                looped = runaway.random(samples_per_prompt) < spec.runaway_rate
                lengths[looped] = spec.max_length
            records += [
                LengthRecord(
                    step=step,
                    prompt_id=f"p{p}",
                    sample=i,
                    prompt_tokens=int(prompt_tokens[p]),
                    response_tokens=int(n),
                )
                for i, n in enumerate(lengths)
            ]
    return records
