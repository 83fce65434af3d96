"""Pure-PyTorch attention over a paged (or absent) KV cache; the CPU backend and the oracle.

Never `is_causal=True` when a sequence has fewer queries than keys: PyTorch aligns that mask to
the top left, so a decode query would see only key 0 (research/feasibility.md §5). The mask
here is built lower-right aligned; `is_causal` is used only for square (all-new) sequences,
where both alignments agree.

Three paths over a cache: a pure decode step (one query a sequence) is one SDPA call over each
sequence's whole blocks, masked to its context; sequences of a few queries each (a speculative
verify step's 1 + d, short prompts, decodes beside a prefill) are one SDPA call too, their
queries padded to the longest and masked causally per row; longer queries go one sequence at
a time (the per-sequence path, also the batched paths' slow twin in tests).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from patrl.rollout.layers.attention.backend import AttentionBackend
from patrl.rollout.layers.attention.context import AttentionContext, HostBatch, upload

# The longest query a sequence may have to join the padded batched path: a verify step's
# 1 + num_speculative_tokens (at most 64) always fits, and a sequence's padding is bounded.
MAX_BATCHED_QUERY = 65


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def __init__(self, max_batched_query: int = MAX_BATCHED_QUERY) -> None:
        """`max_batched_query`: the longest query attended in the padded batched path (1: only
        decodes are batched; tests use it for the per-sequence twin)."""
        if max_batched_query < 1:
            raise ValueError(f"max_batched_query must be >= 1, got {max_batched_query}")
        self.max_batched_query = max_batched_query

    def wants_padded_queries(self, host: HostBatch) -> bool:
        """The padded batched path over every sequence (`small_queries` with `seqs` None):
        a cache, and queries of 2 .. `max_batched_query` tokens (a verify step's)."""
        return host.kv_cache is not None and 1 < host.max_query_len <= self.max_batched_query

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
            if ctx.max_query_len <= self.max_batched_query:  # a verify step, short prompts
                return self.small_queries(q, layer_idx, ctx, None)
        out = torch.empty_like(q)
        starts = [0, *itertools.accumulate(ctx.query_lens)]  # host copy of cu_seqlens_q
        batched = self.batched_seqs(ctx)
        if batched:
            rows = [r for i in batched for r in range(starts[i], starts[i + 1])]
            index = upload(torch.tensor(rows), q.device)
            out[index] = self.small_queries(q[index], layer_idx, ctx, batched)
        skip = set(batched)
        rest = [i for i in range(ctx.num_seqs) if i not in skip]
        keys, values = self.context_kv(k, v, layer_idx, ctx, rest)
        for i, ki, vi in zip(rest, keys, values, strict=True):
            s, e = starts[i], starts[i + 1]
            out[s:e] = self.attend(q[s:e], ki, vi)
        return out

    def batched_seqs(self, ctx: AttentionContext) -> list[int]:
        """Sequences of at most `max_batched_query` queries beside longer ones, attended
        together (one padded gather) when two or more."""
        if ctx.kv_cache is None:
            return []
        small = [i for i, n in enumerate(ctx.query_lens) if n <= self.max_batched_query]
        return small if len(small) > 1 else []

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

    @staticmethod
    def small_queries(
        q: torch.Tensor, layer_idx: int, ctx: AttentionContext, seqs: list[int] | None
    ) -> torch.Tensor:
        """Sequences `seqs` (None = all) with their queries in order, q [T, Hq, D], in one SDPA
        call: each sequence's queries padded to the longest, Qmax, as [B, Hq, Qmax, D], against
        its whole blocks; query j of a sequence with Q new tokens and context L sees keys
        0 .. L - Q + j (a padding row sees the whole context; its output is dropped). The
        layout is built once a forward, on the host from `query_lens`, and kept in `ctx`."""
        assert ctx.kv_cache is not None
        index, limit, tables = ctx.padded_queries(seqs)
        b, width = limit.shape
        k, v = ctx.kv_cache.gather_padded(layer_idx, tables)
        mask = torch.arange(k.shape[1], device=q.device)[None, None, :] <= limit[:, :, None]
        padded = q.new_zeros(b * width, *q.shape[1:]).index_copy_(0, index, q)
        out = F.scaled_dot_product_attention(
            padded.view(b, width, *q.shape[1:]).transpose(1, 2),
            k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None], enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2).reshape(b * width, *q.shape[1:]).index_select(0, index)
