"""Paged attention through patrl's own Triton kernels (CUDA; no package beyond triton).

Each layer writes its new K/V with one kernel, then attends with the paged-decode kernel when
every sequence has one new token, else with the paged-prefill (varlen) kernel, which also takes
mixed prefill + decode batches. A forward without a KV cache goes through the sdpa backend.
Imported only when selected. See docs/attention.md.
"""

from __future__ import annotations

import torch

from patrl.rollout.layers.attention.backend import AttentionBackend
from patrl.rollout.layers.attention.context import AttentionContext
from patrl.rollout.layers.attention.sdpa import SdpaBackend


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        try:
            from patrl.rollout.layers.attention import triton_kernels
        except ImportError as e:
            raise RuntimeError(
                "the triton attention backend needs triton (pip install triton); use 'sdpa' "
                "without it"
            ) from e
        if not torch.cuda.is_available() and not triton_kernels.INTERPRETED:
            raise RuntimeError(
                "the triton attention backend needs CUDA; use 'sdpa' on CPU (its kernels run "
                "on CPU only under TRITON_INTERPRET=1, set before they are imported, for tests)"
            )
        self.kernels = triton_kernels
        self.uncached = SdpaBackend()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        if ctx.kv_cache is None:
            return self.uncached.forward(q, k, v, layer_idx, ctx)
        assert ctx.slot_mapping is not None  # build() sets it with a cache
        k_cache, v_cache = ctx.paged_blocks(layer_idx)
        self.kernels.write_kv(k_cache, v_cache, k, v, ctx.slot_mapping, ctx.write_rows)
        table, lens = ctx.block_table_tensor(), ctx.context_lens_tensor()
        if ctx.max_query_len == 1:  # a pure decode step, the common case
            return self.kernels.paged_decode(q, k_cache, v_cache, table, lens)
        return self.kernels.paged_prefill(
            q, k_cache, v_cache, table, ctx.cu_seqlens_q, lens, ctx.max_query_len
        )
