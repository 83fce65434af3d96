"""Full (unsharded) weights under their Hugging Face names, in buckets of bounded size.

The rollout engine's `load_weights` consumes these buckets and cuts each tensor for its own
tensor-parallel layout. Parameters are gathered one at a time with `DTensor.full_tensor()`
(a collective: every rank of the trainer group iterates in the same order), and a bucket is
handed out before the next parameter is gathered, so the extra memory is at most one bucket
(or one parameter, when a single parameter is larger than `bucket_bytes`).

A LoRA model (lora.py) has three views: every parameter (`iter_full_weights`), the adapters
alone (`iter_adapter_weights`, what the engine's sync needs) and the base with the adapters
folded in (`iter_merged_weights`, a plain Hugging Face model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

Bucket = list[tuple[str, torch.Tensor]]
# (name, bytes once gathered, gather): gather is called in iteration order on every rank.
_Entry = tuple[str, int, Callable[[], torch.Tensor]]


def iter_full_weights(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[Bucket]:
    """Yield lists of `(hf_name, full_tensor)` whose bytes add up to at most `bucket_bytes`.

    Tied parameters appear once, under the first name, as in a HF safetensors file. Without
    FSDP the tensors are the live parameters (detached): consumers must not modify them.
    """
    return _buckets(_entries(model, dtype, lambda name: True), bucket_bytes)


def iter_adapter_weights(
    model: nn.Module,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    modules_to_save: tuple[str, ...] = (),
) -> Iterator[Bucket]:
    """`iter_full_weights` of the LoRA adapters alone (`<module>.lora_A.weight`,
    `<module>.lora_B.weight`): what a LoRA run sends the engine, whose base never changes.
    Plus the parameters of the modules `modules_to_save` names (a value model's head, which
    trains whole: what its PEFT adapter file holds beside the adapters)."""

    def keep(name: str) -> bool:
        return _is_adapter(name) or name.rsplit(".", 1)[0] in modules_to_save

    return _buckets(_entries(model, dtype, keep), bucket_bytes)


def iter_merged_weights(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[Bucket]:
    """The base weights with each adapter folded in (`W + alpha / r * B @ A`, in fp32 before
    the cast to `dtype`), under the base's names; no adapter tensor. Equals
    `iter_full_weights` for a model without adapters."""
    adapted = {
        f"{name}.weight": m for name, m in model.named_modules() if hasattr(m, "lora_scaling")
    }

    def entries() -> Iterator[_Entry]:
        for name, nbytes, gather in _entries(model, dtype, lambda n: not _is_adapter(n)):
            module = adapted.get(name)
            if module is None:
                yield name, nbytes, gather
                continue

            def merged(module: nn.Module = module) -> torch.Tensor:
                base = _full(module.get_parameter("weight"), None)
                a = _full(module.get_parameter("lora_A.weight"), None).float()
                b = _full(module.get_parameter("lora_B.weight"), None).float()
                out = base.float() + (b @ a) * float(getattr(module, "lora_scaling"))  # noqa: B009
                return out.to(dtype or base.dtype)

            yield name, nbytes, merged

    return _buckets(entries(), bucket_bytes)


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _entries(
    model: nn.Module, dtype: torch.dtype | None, keep: Callable[[str], bool]
) -> Iterator[_Entry]:
    for name, param in model.named_parameters():
        if not keep(name):
            continue
        itemsize = (dtype or param.dtype).itemsize
        nbytes = param.numel() * itemsize  # the global numel, also for a DTensor
        yield name, nbytes, functools.partial(_full, param, dtype)


def _buckets(entries: Iterator[_Entry], bucket_bytes: int) -> Iterator[Bucket]:
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, nbytes, gather in entries:
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, gather()))
        size += nbytes
    if bucket:
        yield bucket


def _full(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    with torch.no_grad():
        data = param.detach()
        full = data.full_tensor() if isinstance(data, DTensor) else data
        return full if dtype is None else full.to(dtype)
