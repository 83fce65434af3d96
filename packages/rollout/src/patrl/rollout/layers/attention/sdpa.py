"""Pure-PyTorch attention over a paged (or absent) KV cache; the CPU backend and the oracle.

Never `is_causal=True` when a sequence has fewer queries than keys: PyTorch aligns that mask to
the top left, so a decode query would see only key 0 (research/feasibility.md §5). The mask
here is built lower-right aligned; `is_causal` is used only for square (all-new) sequences,
where both alignments agree.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from patrl.rollout.layers.attention.backend import AttentionBackend
from patrl.rollout.layers.attention.context import AttentionContext, upload


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        if ctx.kv_cache is not None:
            ctx.store_kv(layer_idx, k, v)
            if ctx.max_query_len == 1:  # a pure decode step, the common case
                return self.decode(q, layer_idx, ctx, None)
        out = torch.empty_like(q)
        starts = [0, *itertools.accumulate(ctx.query_lens)]  # host copy of cu_seqlens_q
        decodes = self.batched_decodes(ctx)
        if decodes:
            rows = upload(torch.tensor([starts[i] for i in decodes]), q.device)
            out[rows] = self.decode(q[rows], layer_idx, ctx, decodes)
        skip = set(decodes)
        rest = [i for i in range(ctx.num_seqs) if i not in skip]
        keys, values = self.context_kv(k, v, layer_idx, ctx, rest)
        for i, ki, vi in zip(rest, keys, values, strict=True):
            s, e = starts[i], starts[i + 1]
            out[s:e] = self.attend(q[s:e], ki, vi)
        return out

    @staticmethod
    def batched_decodes(ctx: AttentionContext) -> list[int]:
        """Decodes beside prefills, attended together (one padded gather) when two or more."""
        if ctx.kv_cache is None:
            return []
        decodes = [i for i, n in enumerate(ctx.query_lens) if n == 1]
        return decodes if len(decodes) > 1 else []

    @staticmethod
    def context_kv(
        k: torch.Tensor, v: torch.Tensor, layer_idx: int, ctx: AttentionContext, seqs: list[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The whole context K and V of sequences `seqs`, [ctx_len, kv_heads, D] each."""
        if ctx.kv_cache is None:
            ks, vs = k.split(ctx.query_lens), v.split(ctx.query_lens)
            return [ks[i] for i in seqs], [vs[i] for i in seqs]
        assert ctx.block_tables is not None  # build() checks
        tables = [ctx.block_tables[i] for i in seqs]
        return ctx.kv_cache.gather(layer_idx, tables, [ctx.context_lens[i] for i in seqs])

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One sequence: q [Q, Hq, D] against k, v [L, Hk, D] -> [Q, Hq, D]."""
        n_q, n_k = q.shape[0], k.shape[0]
        qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if n_q == n_k:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        else:
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)

    @staticmethod
    def decode(
        q: torch.Tensor, layer_idx: int, ctx: AttentionContext, seqs: list[int] | None
    ) -> torch.Tensor:
        """One query per sequence (`seqs`, None = all), q [B, Hq, D], against whole blocks
        masked to each context."""
        assert ctx.kv_cache is not None
        tables, lens = ctx.block_table_tensor(), ctx.context_lens_tensor()
        if seqs is not None:
            index = upload(torch.tensor(seqs), q.device)
            tables, lens = tables[index], lens[index]
        k, v = ctx.kv_cache.gather_padded(layer_idx, tables)
        valid = torch.arange(k.shape[1], device=q.device)[None, :] < lens[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=valid[:, None, None, :], enable_gqa=True,
        )  # fmt: skip
        return out[:, :, 0, :]
