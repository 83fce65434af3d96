"""Full (unsharded) weights under their Hugging Face names, in buckets of bounded size.

The rollout engine's `load_weights` consumes these buckets and cuts each tensor for its own
tensor-parallel layout. Parameters are gathered one at a time with `DTensor.full_tensor()`
(a collective: every rank of the trainer group iterates in the same order), and a bucket is
handed out before the next parameter is gathered, so the extra memory is at most one bucket
(or one parameter, when a single parameter is larger than `bucket_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

Bucket = list[tuple[str, torch.Tensor]]


def iter_full_weights(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[Bucket]:
    """Yield lists of `(hf_name, full_tensor)` whose bytes add up to at most `bucket_bytes`.

    Tied parameters appear once, under the first name, as in a HF safetensors file. Without
    FSDP the tensors are the live parameters (detached): consumers must not modify them.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, param in model.named_parameters():
        itemsize = (dtype or param.dtype).itemsize
        nbytes = param.numel() * itemsize  # the global numel, also for a DTensor
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, _full(param, dtype)))
        size += nbytes
    if bucket:
        yield bucket


def _full(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    with torch.no_grad():
        data = param.detach()
        full = data.full_tensor() if isinstance(data, DTensor) else data
        return full if dtype is None else full.to(dtype)
