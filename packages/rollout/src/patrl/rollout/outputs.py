"""What the engine hands back: finished requests, and requests in flight to move elsewhere."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from patrl.kvstore import SequenceKV
from patrl.rollout.sampler import SamplingParams
from patrl.rollout.sequence import Request


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. `logprobs[i]` is the logprob of `token_ids[i]` under the
    sampler's shared convention (log_softmax(logits / T) over the full vocabulary; T = 1 for
    greedy). `finish_reason`: "stop" (EOS or a stop id), "length" (max_tokens or
    max_model_len), "abort", or "rejected" (it could not run; see RequestOutput.error)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    time_to_first_token_s: float | None = None
    latency_s: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    error: str | None = None


@dataclass(slots=True)
class SequenceState:
    """An unfinished sample, detached from its engine, to continue on another replica.

    With `kv` the receiver imports the KV of `kv.token_ids` (the prompt and all but the last
    sampled token) and decodes on; without it the receiver recomputes it by a prefill. The
    generator state makes the continuation sample exactly what the sender would have.
    """

    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    params: SamplingParams
    generator_state: torch.Tensor
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    kv: SequenceKV | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None  # set: this sample is done, only carried along


def request_output(request: Request, decode: Callable[[list[int]], str | None]) -> RequestOutput:
    """The output of a finished `request`, its samples in index order (`decode`: text)."""
    completions = []
    for index in sorted(request.seqs):
        s = request.seqs[index]
        completions.append(
            CompletionOutput(
                index=index,
                token_ids=list(s.output_token_ids),
                logprobs=list(s.output_logprobs),
                finish_reason=s.finish_reason or "abort",
                text=decode(s.output_token_ids),
                top_logprobs=list(s.output_top_logprobs) if s.params.logprobs else None,
                num_preemptions=s.num_preemptions,
                time_to_first_token_s=None
                if s.first_token_time is None
                else s.first_token_time - s.arrival_time,
                latency_s=None if s.finish_time is None else s.finish_time - s.arrival_time,
            )
        )
    return RequestOutput(request.request_id, request.prompt_token_ids, completions, request.error)
