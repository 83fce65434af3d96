"""One sample being generated: its tokens, logprobs, generator and lifecycle."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from patrl.rollout.detokenizer import StopStringChecker
from patrl.rollout.sampler import HostSamples, SamplingParams, make_generator


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # needs (re)prefill: new, preempted, or imported without KV
    RUNNING = "running"  # KV of all but its last sampled token is in the cache
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Seq:
    """One of a request's `n` samples, with its own generator. `fork_children`: the other
    samples of a fresh request while this one (the leader) prefills the shared prompt; they
    then sample their first token from the same logits and take over its blocks by `fork`
    (with prefix caching, also fresh samples of other requests of the same prompt)."""

    seq_id: int
    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string it ended at
    fork_children: list[Seq] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    weight_version: int = 0  # policy version of the weights that sampled the latest token
    # the request's prompt key (add_request), grouping samples of one prompt for drafts
    prompt_key: str | None = None
    # the text so far, for a sample with stop strings (made at its first check: derived)
    stop_checker: StopStringChecker | None = None
    # finished ("stop"/"length"), it is kept with its KV for `Engine.continue_request`
    keep: bool = False
    # equal for equal prompts (a collision only delays a prefill by a step: the prefix cache
    # compares tokens), so the scheduler can compute a prompt repeated in requests once
    prompt_hash: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.prompt_hash = hash(tuple(self.prompt_token_ids))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def last_tokens(self, n: int) -> list[int]:
        """The last `n` of `token_ids` (fewer when it is shorter), without building it."""
        out = self.output_token_ids
        if len(out) >= n:
            return out[len(out) - n :]
        return self.prompt_token_ids[max(0, len(self.prompt_token_ids) - n + len(out)) :] + out

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def group_size(self) -> int:
        """How many samples this sequence stands for in the batch (itself + fork children)."""
        return 1 + len(self.fork_children)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int, logprob: float, top: dict[int, float] | None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_token_ids.append(token)
        self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)

    def emit(
        self,
        host: HostSamples,
        rows: list[int],
        eos_token_ids: frozenset[int],
        max_model_len: int,
        tokenizer: Any = None,
    ) -> tuple[int, str | None]:
        """Append the tokens of `rows` of `host` in order, up to the first that ends the
        sequence; returns how many it appended and why it must stop (None: it goes on)."""
        for n, row in enumerate(rows, 1):
            self.append_token(
                host.tokens[row], host.logprobs[row], host.top(row, self.params.logprobs)
            )
            reason = self.check_stop(eos_token_ids, max_model_len, tokenizer)
            if reason is not None:
                return n, reason
        return len(rows), None

    def check_stop(
        self, eos_token_ids: frozenset[int], max_model_len: int, tokenizer: Any = None
    ) -> str | None:
        """Why this sequence must stop after its newest token ("stop", "length"), or None;
        sets `stop_reason` for a stop token id or stop string (vLLM's order: EOS, stop ids,
        stop strings, then length). `tokenizer`: needed when the params have stop strings."""
        token = self.output_token_ids[-1]
        p = self.params
        if not p.ignore_eos and token in eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            self.stop_reason = token
            return "stop"
        if p.stop and self._reaches_stop_string(tokenizer):
            return "stop"
        if len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def _reaches_stop_string(self, tokenizer: Any) -> bool:
        if self.stop_checker is None:  # a fresh sample, or one continued from elsewhere
            self.stop_checker = stop_checker_for(self.params, tokenizer, self.output_token_ids[:-1])
        found = self.stop_checker.update(self.output_token_ids)
        if found is not None:
            self.stop_reason = found
        return found is not None

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()


def stop_checker_for(
    params: SamplingParams, tokenizer: Any, token_ids: list[int]
) -> StopStringChecker:
    """The stop-string checker of a sample with `params` that has output `token_ids`."""
    if tokenizer is None:
        raise ValueError(f"stop strings {list(params.stop)} need a tokenizer")
    p = params
    return StopStringChecker.replay(
        tokenizer, p.stop, p.include_stop_str_in_output, p.skip_special_tokens, token_ids
    )


@dataclass(slots=True)
class Request:
    """The samples of one request in an engine, by sample index; `error` is why it was
    rejected (its samples then finish as "rejected")."""

    request_id: str
    prompt_token_ids: list[int]
    seqs: dict[int, Seq] = field(default_factory=dict)
    error: str | None = None

    def done(self) -> bool:
        return all(s.is_finished for s in self.seqs.values())


@dataclass(slots=True)
class IdCounter:
    """Consecutive ids: `take` hands out `next` and moves on."""

    next: int = 0

    def take(self) -> int:
        self.next += 1
        return self.next - 1


def new_request(
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    seq_ids: IdCounter,
    prompt_key: str | None = None,
    keep: bool = False,
) -> Request:
    """A request of `params.n` fresh samples, sample i drawing from a generator seeded with
    `params.seed + i` (a random one without a seed); `prompt_key` groups them for drafts;
    `keep`: each is kept with its KV when it completes (patrl.rollout.kept)."""
    request = Request(request_id, token_ids)
    for i in range(params.n):
        seed = None if params.seed is None else params.seed + i
        generator = make_generator(seed)
        request.seqs[i] = Seq(
            seq_ids.take(),
            request_id,
            i,
            list(token_ids),
            params,
            generator,
            prompt_key=prompt_key,
            keep=keep,
        )
    return request
