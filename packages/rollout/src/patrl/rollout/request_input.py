"""What callers hand the engine, checked: prompts as token ids, and one sampling params and
prompt key per prompt. A prompt the engine cannot run is not an exception: its request is
rejected (finishes with finish_reason "rejected" and the reason)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from patrl.rollout.sampler import SamplingParams


def encode(prompt: Sequence[int] | str, tokenizer: Any, model: str) -> list[int]:
    """`prompt` as token ids (text through `tokenizer`, which `model` may lack)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{model} has no tokenizer: pass token ids, not text")
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    return [int(t) for t in prompt]


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
) -> tuple[Sequence[SamplingParams], Sequence[str | None]]:
    """`generate`'s arguments as one params and one key per prompt (checked lengths)."""
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    keys: Sequence[str | None] = prompt_keys if prompt_keys is not None else [None] * len(prompts)
    if len(keys) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(keys)} prompt keys")
    return params, keys


def progress_bar(total: int) -> Any:
    """A progress bar over `total` requests."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
