"""Pure-PyTorch attention over a paged (or absent) KV cache; the CPU backend and the oracle.

Never `is_causal=True` when a sequence has fewer queries than keys: PyTorch aligns that mask to
the top left, so a decode query would see only key 0 (research/feasibility.md §5). The mask
here is built lower-right aligned; `is_causal` is used only for square (all-new) sequences,
where both alignments agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from patrl.rollout.layers.attention.backend import AttentionBackend
from patrl.rollout.layers.attention.context import AttentionContext


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
        keys, values = self.context_kv(k, v, layer_idx, ctx)
        queries = q.split(ctx.query_lens)
        out = torch.empty_like(q)
        decode = [i for i, n in enumerate(ctx.query_lens) if n == 1]
        if len(decode) > 1:
            rows = ctx.cu_seqlens_q[:-1].long()[decode]
            out[rows] = self.decode(q[rows], [keys[i] for i in decode], [values[i] for i in decode])
            done = set(decode)
        else:
            done = set()
        offset = 0
        for i, n in enumerate(ctx.query_lens):
            if i not in done:
                out[offset : offset + n] = self.attend(queries[i], keys[i], values[i])
            offset += n
        return out

    def context_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, ctx: AttentionContext
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every sequence's whole context K and V, [ctx_len, kv_heads, D] each."""
        if ctx.kv_cache is None:
            return list(k.split(ctx.query_lens)), list(v.split(ctx.query_lens))
        assert ctx.slot_mapping is not None and ctx.block_tables is not None  # build() checks
        ctx.kv_cache.write(layer_idx, ctx.slot_mapping, k, v)
        return ctx.kv_cache.gather(layer_idx, ctx.block_tables, ctx.context_lens)

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
        q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> torch.Tensor:
        """Many one-token queries at once: q [B, Hq, D], contexts padded to the longest."""
        lens = torch.tensor([x.shape[0] for x in keys], device=q.device)
        k = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True).transpose(1, 2)
        v = torch.nn.utils.rnn.pad_sequence(values, batch_first=True).transpose(1, 2)
        valid = torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], enable_gqa=True
        )
        return out[:, :, 0, :]
