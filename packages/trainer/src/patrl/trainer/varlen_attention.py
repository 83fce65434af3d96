"""`patrl_varlen`: a Hugging Face attention implementation for packed rows on any device.

Registered with transformers' `AttentionInterface`; given the packed row's `patrl_bounds`
(host-side sample offsets) it runs causal SDPA per sample, so no token attends across a
sample and no `[total, total]` mask is built; without them it is causal SDPA over the whole
row (one unpadded sequence). No mask function is registered, so HF builds none.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "patrl_varlen"


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    patrl_bounds: tuple[int, ...] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`query` `[1, heads, total, dim]`, `key` / `value` `[1, kv_heads, total, dim]` ->
    `([1, total, heads, dim], None)`, causal within each `[bounds[i], bounds[i+1])`."""
    if attention_mask is not None:
        raise ValueError(f"{NAME} takes packed rows without an attention mask")
    gqa = query.shape[1] != key.shape[1]
    total = query.shape[2]
    bounds = patrl_bounds if patrl_bounds is not None else (0, total)
    if bounds[-1] != total:
        raise ValueError(f"patrl_bounds end at {bounds[-1]} but the row has {total} tokens")
    # split(), not one slice per sample: its backward is one cat of the pieces' gradients,
    # where each slice's backward would write a zero-filled gradient of the whole row.
    sizes = [b - a for a, b in pairwise(bounds)]
    outs = [
        F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
        )
        for q, k, v in zip(
            query.split(sizes, dim=2),
            key.split(sizes, dim=2),
            value.split(sizes, dim=2),
            strict=True,
        )
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `attn_implementation=NAME` known to transformers; idempotent. Returns NAME."""
    AttentionInterface.register(NAME, varlen_attention_forward)
    return NAME
