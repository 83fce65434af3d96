"""What callers hand the engine, checked: prompts as token ids, and one sampling params and
prompt key per prompt. A prompt the engine cannot run is not an exception: its request is
rejected (finishes with finish_reason "rejected" and the reason)."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import torch

from patrl.rollout.sampler import SamplingParams
from patrl.tpreshard import ParallelLayout, tp_broadcast


def encode(prompt: Sequence[int] | str, tokenizer: Any, model: str) -> list[int]:
    """`prompt` as token ids (text through `tokenizer`, which `model` may lack)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{model} has no tokenizer: pass token ids, not text")
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    return [int(t) for t in prompt]


Conversation: TypeAlias = Sequence[Mapping[str, Any]]


def render_chat(
    tokenizer: Any,
    model: str,
    messages: Conversation | Sequence[Conversation],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Each conversation of `messages` (one conversation of {"role", "content", ...} dicts, or
    a list of them) rendered by the chat template (the tokenizer's, or `chat_template`) and
    encoded without adding special tokens (the template holds them), as vLLM's `LLM.chat`
    does. Raises ValueError naming `model` when it has no tokenizer or chat template."""
    if tokenizer is None:
        raise ValueError(f"chat() needs a tokenizer with a chat template, and {model} has none")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of {model} has no chat template (tokenizer_config.json's "
            "chat_template or chat_template.jinja): pass chat_template=..., or render the "
            "prompts yourself and call generate()"
        )
    if not messages:
        raise ValueError("chat() got no messages")
    one = all(isinstance(m, Mapping) for m in messages)
    conversations: list[Any] = [messages] if one else list(messages)  # checked below
    prompts = []
    for i, conversation in enumerate(conversations):
        if isinstance(conversation, Mapping | str) or not conversation:
            raise ValueError(
                f"conversation {i} must be a non-empty list of message dicts, got "
                f"{conversation!r:.80}"
            )
        for j, message in enumerate(conversation):
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(
                    f"conversation {i}, message {j}: a message is a dict with a 'role' "
                    f"(and usually 'content'), got {message!r:.80}"
                )
        text = tokenizer.apply_chat_template(
            [dict(m) for m in conversation],
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def check_params(params: SamplingParams, tokenizer: Any, vocab: int, model: str) -> None:
    """Raise, naming the value, for sampling params this engine cannot honour: stop strings
    without a tokenizer, more top logprobs than `vocab` tokens."""
    if params.stop and tokenizer is None:
        raise ValueError(
            f"stop strings {list(params.stop)} need a tokenizer, and {model} has none: "
            "pass stop_token_ids instead, or a model directory with tokenizer files"
        )
    if params.logprobs is not None and params.logprobs > vocab:
        raise ValueError(
            f"logprobs={params.logprobs} exceeds the vocabulary of {vocab} tokens of {model}"
        )


def with_group_seed(
    params: SamplingParams, layout: ParallelLayout, device: torch.device
) -> SamplingParams:
    """`params`, with a seed drawn by the TP group's first rank when it samples without one:
    the group samples as one replica, so its ranks must draw one stream (OS-random: torch's
    global generator is the trainer's; broadcast on the device, as NCCL wants)."""
    if params.seed is not None or params.temperature == 0 or layout.tp_size == 1:
        return params
    drawn = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=device)
    return dataclasses.replace(params, seed=int(tp_broadcast(layout, drawn, src=0).item()))


def reject_reason(token_ids: list[int], max_model_len: int, vocab: int) -> str | None:
    """Why a prompt cannot run (empty, too long, ids outside the vocabulary), or None."""
    if not token_ids:
        return "empty prompt"
    if len(token_ids) >= max_model_len:
        return (
            f"prompt of {len(token_ids)} tokens leaves no room to generate within "
            f"max_model_len={max_model_len}"
        )
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        return f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
    return None


def check_batch(
    prompts: Sequence[Sequence[int] | str],
    params: SamplingParams | Sequence[SamplingParams] | None,
    prompt_keys: Sequence[str] | None,
    check: Callable[[SamplingParams], None] = lambda _: None,
) -> tuple[Sequence[SamplingParams], Sequence[str | None]]:
    """`generate`'s arguments as one params and one key per prompt (checked lengths; each
    distinct params through `check`, so nothing is queued before a bad one raises)."""
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    for distinct in set(params):
        check(distinct)
    keys: Sequence[str | None] = prompt_keys if prompt_keys is not None else [None] * len(prompts)
    if len(keys) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(keys)} prompt keys")
    return params, keys


class NoProgressBar:
    """What `progress_bar` gives when off: tqdm's calls, doing nothing."""

    disable = True

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, show: bool = True) -> Any:
    """A progress bar over `total` requests (one that shows nothing unless `show`)."""
    if not show:
        return NoProgressBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
