"""What the engine hands back: finished requests, and requests in flight to move elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from patrl.kvstore import SequenceKV
from patrl.rollout.sampler import SamplingParams
from patrl.rollout.sequence import Request, Seq, stop_checker_for


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (vLLM's `CompletionOutput`, plus per-token floats and timing).

    `token_ids` are the sampled tokens, the one that ended the sample included (EOS, a stop
    id, or the token that completed a stop string). `logprobs[i]` is the logprob of
    `token_ids[i]` under the sampler's shared convention (log_softmax(logits / T) over the full
    vocabulary; T = 1 for greedy), always present. `top_logprobs[i]` (only when
    `SamplingParams.logprobs` is not None) holds that many top tokens' logprobs and the
    sampled token's, by token id. `text` is the decoded output (None without a tokenizer):
    cut before the stop string, or at EOS / a stop id, unless `include_stop_str_in_output`.
    `finish_reason`: "stop" (EOS, a stop id or a stop string), "length" (max_tokens or
    max_model_len), "abort", or "rejected" (it could not run; see RequestOutput.error);
    `stop_reason`: the stop id (int) or stop string (str) it stopped at, None otherwise."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    time_to_first_token_s: float | None = None
    latency_s: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request: its id, prompt token ids and its samples in index order; `error`
    says why it was rejected (its samples then have finish_reason "rejected")."""

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
    stop_reason: int | str | None = None
    # a multi-turn turn's: kept with its KV when it completes (patrl.rollout.kept), and its
    # prompt's key (drafts); a fold or a move must not lose them
    keep: bool = False
    prompt_key: str | None = None


def completion_text(seq: Seq, tokenizer: Any) -> str | None:
    """The text of a finished `seq` as vLLM returns it (None without a tokenizer): up to
    its stop string (or through it, with include_stop_str_in_output), else all of its
    tokens but an ending EOS or stop id (kept with include_stop_str_in_output)."""
    if tokenizer is None:
        return None
    p, ids = seq.params, seq.output_token_ids
    if isinstance(seq.stop_reason, str):
        checker = seq.stop_checker or stop_checker_for(p, tokenizer, ids)
        return checker.text
    if seq.finish_reason == "stop" and ids and not p.include_stop_str_in_output:
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens))


def request_output(request: Request, tokenizer: Any) -> RequestOutput:
    """The output of a finished `request`, its samples in index order (text decoded with
    `tokenizer`, when there is one)."""
    completions = []
    for index in sorted(request.seqs):
        s = request.seqs[index]
        completions.append(
            CompletionOutput(
                index=index,
                token_ids=list(s.output_token_ids),
                logprobs=list(s.output_logprobs),
                finish_reason=s.finish_reason or "abort",
                text=completion_text(s, tokenizer),
                top_logprobs=None if s.params.logprobs is None else list(s.output_top_logprobs),
                stop_reason=s.stop_reason,
                num_preemptions=s.num_preemptions,
                time_to_first_token_s=None
                if s.first_token_time is None
                else s.first_token_time - s.arrival_time,
                latency_s=None if s.finish_time is None else s.finish_time - s.arrival_time,
            )
        )
    return RequestOutput(request.request_id, request.prompt_token_ids, completions, request.error)
