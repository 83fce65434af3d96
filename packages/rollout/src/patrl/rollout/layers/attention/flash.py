"""flash-attn attention over the paged KV cache (CUDA only).

Imported only when the `flash` backend is selected, so CPU machines never touch flash_attn.
A pure decode step goes through `flash_attn_with_kvcache` (one query per sequence, the block
table and each sequence's cached length), everything else through `flash_attn_varlen_func` with
the block table. flash-attn's causal mask is aligned to the lower right (since 2.1), which is
what prefix hits, chunked prefill and decode need. Its paged path requires block_size % 256 == 0
(the registry's block-size rule).
"""

from __future__ import annotations

from typing import Any

import torch

from patrl.rollout.layers.attention.backend import AttentionBackend
from patrl.rollout.layers.attention.context import AttentionContext


class FlashBackend(AttentionBackend):
    name = "flash"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the flash attention backend needs CUDA; use 'sdpa' on CPU")
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as e:
            raise RuntimeError(
                "the flash attention backend needs flash-attn "
                "(pip install 'patrl-rollout[cuda]'); use 'sdpa' without it"
            ) from e
        self.varlen: Any = flash_attn_varlen_func
        self.with_kvcache: Any = flash_attn_with_kvcache

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        if ctx.kv_cache is None:
            return self.varlen(
                q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_q,
                ctx.max_query_len, ctx.max_query_len, causal=True,
            )  # fmt: skip
        ctx.store_kv(layer_idx, k, v)
        k_cache, v_cache = ctx.paged_blocks(layer_idx)
        if ctx.max_query_len == 1:  # a pure decode step: q [B, 1, Hq, D]
            out = self.with_kvcache(
                q.unsqueeze(1), k_cache, v_cache,
                cache_seqlens=ctx.context_lens_tensor(),
                block_table=ctx.block_table_tensor(), causal=True,
            )  # fmt: skip
            return out.squeeze(1)
        return self.varlen(
            q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
            ctx.max_query_len, ctx.max_context_len, causal=True,
            block_table=ctx.block_table_tensor(),
        )  # fmt: skip
