"""What attention needs to know about one forward pass, passed explicitly (never a global).

A forward runs on a flattened variable-length batch: the new tokens of every sequence are
concatenated into one [T, ...] tensor. Sequence i contributes `query_lens[i]` new tokens and,
after this step, holds `context_lens[i]` tokens of KV in total (cached + new); its new tokens sit
at positions `context_lens[i] - query_lens[i] ... context_lens[i] - 1`. That one convention
covers prefill (cached 0), prefill after a prefix-cache hit or in chunks (cached > 0, many new
tokens) and decode (one new token). With a KV cache, the new K/V go to `slot_mapping` (flat slot = block_id * block_size + offset;
-1 = do not store) and each sequence's whole context is read back through its block table.
Without one, every sequence must be entirely new (context_len == query_len).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class KVCache(Protocol):
    """The paged KV store as attention sees it (patrl.kvstore.PagedKVCache provides this)."""

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v [n, kv_heads, head_dim] of layer `layer` at flat slots [n]; skip slot -1."""
        ...

    def gather(
        self, layer: int, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sequence, its first context_len K and V rows: lists of [ctx_len, kv_heads, D]."""
        ...

    def gather_padded(
        self, layer: int, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, [B, max_blocks * block_size, kv_heads, D], one index op.

        `block_tables` is [B, max_blocks] padded with a valid block id; the caller masks every
        position past a sequence's context length.
        """
        ...


class PagedKVTensors(KVCache, Protocol):
    """What a fused paged kernel (flash) reads on top of `KVCache`: the raw block tensors.

    `k[layer]` and `v[layer]` are [num_blocks, block_size, kv_heads, head_dim].
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]


@dataclass(slots=True)
class AttentionContext:
    """Per-forward attention metadata; build it with `AttentionContext.build`."""

    query_lens: list[int]
    context_lens: list[int]
    positions: torch.Tensor  # [T] int64: rotary position of every new token
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: where each sequence's queries start in T
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: the same over context lengths
    slot_mapping: torch.Tensor | None = None  # [T] int64; -1 = skip
    block_tables: list[list[int]] | None = None
    kv_cache: KVCache | None = None
    _block_table_tensor: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int] | None = None,
        *,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
        block_tables: Sequence[Sequence[int]] | None = None,
        kv_cache: KVCache | None = None,
        device: torch.device | str | None = None,
    ) -> AttentionContext:
        """Derive positions and offsets; `context_lens` defaults to `query_lens` (no cache)."""
        q_lens = [int(n) for n in query_lens]
        ctx_lens = q_lens if context_lens is None else [int(n) for n in context_lens]
        _check_lengths(q_lens, ctx_lens)
        total = sum(q_lens)
        slots = None
        if kv_cache is not None:
            if slot_mapping is None or block_tables is None:
                raise ValueError("a kv_cache needs both slot_mapping and block_tables")
            slots = torch.as_tensor(slot_mapping, dtype=torch.int64, device=device)
            if slots.shape != (total,):
                raise ValueError(
                    f"slot_mapping has shape {tuple(slots.shape)}, expected ({total},) = "
                    "one slot per new token"
                )
            if len(block_tables) != len(q_lens):
                raise ValueError(f"{len(block_tables)} block tables for {len(q_lens)} sequences")
        elif ctx_lens != q_lens:
            raise ValueError(
                f"without a kv_cache every token must be new: context_lens {ctx_lens} != "
                f"query_lens {q_lens}"
            )
        q = torch.tensor(q_lens, dtype=torch.int64)
        ctx = torch.tensor(ctx_lens, dtype=torch.int64)
        cu_q = _cumsum0(q)
        starts = torch.repeat_interleave(ctx - q - cu_q[:-1], q)
        positions = torch.arange(total, dtype=torch.int64) + starts
        return cls(
            query_lens=q_lens,
            context_lens=ctx_lens,
            positions=positions.to(device),
            cu_seqlens_q=cu_q.to(device=device, dtype=torch.int32),
            cu_seqlens_k=_cumsum0(ctx).to(device=device, dtype=torch.int32),
            slot_mapping=slots,
            block_tables=None if block_tables is None else [list(b) for b in block_tables],
            kv_cache=kv_cache,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens)

    def last_token_indices(self) -> torch.Tensor:
        """Row of each sequence's last new token in the flattened batch (the one to sample)."""
        return (self.cu_seqlens_q[1:] - 1).long()

    def block_table_tensor(self) -> torch.Tensor:
        """Block tables as an int32 [B, max_blocks] tensor, zero-padded (for fused kernels)."""
        if self._block_table_tensor is None:
            if self.block_tables is None:
                raise ValueError("this context has no block tables")
            width = max(len(b) for b in self.block_tables)
            table = torch.zeros(len(self.block_tables), width, dtype=torch.int32)
            for i, blocks in enumerate(self.block_tables):
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            self._block_table_tensor = table.to(self.positions.device)
        return self._block_table_tensor


def _cumsum0(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.new_zeros(1), x.cumsum(0)])


def _check_lengths(q_lens: list[int], ctx_lens: list[int]) -> None:
    if not q_lens:
        raise ValueError("an attention batch needs at least one sequence")
    if len(q_lens) != len(ctx_lens):
        raise ValueError(f"{len(q_lens)} query_lens but {len(ctx_lens)} context_lens")
    for i, (q, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        # q == 0 would hand a kernel an empty query (nano-vllm #144); recompute the last token.
        if not 1 <= q <= c:
            raise ValueError(
                f"sequence {i}: need 1 <= query_len <= context_len, got query_len={q}, "
                f"context_len={c}"
            )
