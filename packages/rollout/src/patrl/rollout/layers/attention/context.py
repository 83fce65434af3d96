"""What attention needs to know about one forward pass, passed explicitly (never a global).

A forward runs on a flattened variable-length batch: the new tokens of every sequence are
concatenated into one [T, ...] tensor. Sequence i contributes `query_lens[i]` new tokens and,
after this step, holds `context_lens[i]` tokens of KV in total (cached + new); its new tokens sit
at positions `context_lens[i] - query_lens[i] ... context_lens[i] - 1`. That one convention
covers prefill (cached 0), prefill after a prefix-cache hit or in chunks (cached > 0, many new
tokens) and decode (one new token). With a KV cache, the new K/V go to `slot_mapping` (flat
slot = block_id * block_size + offset; -1 = do not store) and each sequence's whole context is
read back through its block table. Without one, every sequence must be entirely new
(context_len == query_len). Every index is built and checked on the host, then uploaded once
(`upload`): no layer reads a device tensor back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class KVCache(Protocol):
    """The paged KV store as attention sees it (patrl.kvstore.PagedKVCache provides this)."""

    @property
    def capacity_tokens(self) -> int:
        """How many slots the cache has: valid slots are [0, capacity_tokens)."""
        ...

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v [n, kv_heads, head_dim] of layer `layer` at flat slots [n]; skip slot -1."""
        ...

    def write_slots(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """`write` for slots all in [0, capacity_tokens), checked by the caller: no host sync."""
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


PaddedQueries = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""`AttentionContext.padded_queries`' layout: (index [T], limit [B, Qmax], block tables)."""


@dataclass(slots=True)
class AttentionContext:
    """Per-forward attention metadata; build it with `AttentionContext.build`."""

    query_lens: list[int]
    context_lens: list[int]
    positions: torch.Tensor  # [T] int64: rotary position of every new token
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: where each sequence's queries start in T
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: the same over context lengths
    slot_mapping: torch.Tensor | None = None  # [W] int64: where the written rows go
    write_rows: torch.Tensor | None = None  # [W] int64: rows of k/v to write; None = all T
    block_tables: list[list[int]] | None = None
    kv_cache: KVCache | None = None
    _block_table_tensor: torch.Tensor | None = field(default=None, repr=False)
    _padded: dict[tuple[int, ...] | None, PaddedQueries] = field(default_factory=dict, repr=False)

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
        """Derive positions and offsets; `context_lens` defaults to `query_lens` (no cache).

        `slot_mapping` (-1 = do not store) is checked against the cache's capacity here, on
        the host, so the layers can write without checks."""
        q_lens = [int(n) for n in query_lens]
        ctx_lens = q_lens if context_lens is None else [int(n) for n in context_lens]
        _check_lengths(q_lens, ctx_lens)
        total = sum(q_lens)
        slots = rows = None
        if kv_cache is not None:
            if slot_mapping is None or block_tables is None:
                raise ValueError("a kv_cache needs both slot_mapping and block_tables")
            slots, rows = _checked_slots(slot_mapping, total, kv_cache.capacity_tokens)
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
            positions=upload(positions, device),
            cu_seqlens_q=upload(cu_q.int(), device),
            cu_seqlens_k=upload(_cumsum0(ctx).int(), device),
            slot_mapping=None if slots is None else upload(slots, device),
            write_rows=None if rows is None else upload(rows, device),
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

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' k, v [T, kv_heads, D] of `layer` to the cache, unchecked
        (`build` checked the slots)."""
        assert self.kv_cache is not None and self.slot_mapping is not None
        if self.write_rows is not None:
            k, v = k.index_select(0, self.write_rows), v.index_select(0, self.write_rows)
        self.kv_cache.write_slots(layer, self.slot_mapping, k, v)

    def paged_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's K and V blocks of `layer`, [num_blocks, block_size, kv_heads, D], for
        kernels that read the pages directly; a cache without them raises (PagedKVTensors)."""
        k, v = getattr(self.kv_cache, "k", None), getattr(self.kv_cache, "v", None)
        if k is None or v is None:
            raise TypeError(
                f"{type(self.kv_cache).__name__} has no per-layer block tensors k and v; a "
                "fused paged kernel reads the blocks directly (see PagedKVTensors)"
            )
        return k[layer], v[layer]

    def context_lens_tensor(self) -> torch.Tensor:
        """`context_lens` as a [B] int32 tensor on the device, from `cu_seqlens_k`."""
        return self.cu_seqlens_k[1:] - self.cu_seqlens_k[:-1]

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
            self._block_table_tensor = upload(table, self.positions.device)
        return self._block_table_tensor

    def padded_queries(self, seqs: Sequence[int] | None = None) -> PaddedQueries:
        """The layout of sequences `seqs` (None = all; their queries taken in order) with their
        queries padded to the longest, Qmax, for one batched attention call:
        - index [T] int64: the padded row (b * Qmax + j) of each of their T query tokens;
        - limit [B, Qmax] int64: the last key position row (b, j) may see, L - Q + j for
          query j of a sequence with Q new tokens and context L, and L - 1 on padding rows;
        - their block tables, [B, max_blocks] int32.
        Built on the host from `query_lens` and `context_lens`, uploaded once and kept for the
        forward's other layers."""
        key = None if seqs is None else tuple(seqs)
        found = self._padded.get(key)
        if found is not None:
            return found
        chosen = range(self.num_seqs) if seqs is None else seqs
        q_lens = [self.query_lens[i] for i in chosen]
        width = max(q_lens)
        index: list[int] = []
        limit: list[list[int]] = []
        for b, i in enumerate(chosen):
            n, c = self.query_lens[i], self.context_lens[i]
            index += range(b * width, b * width + n)
            limit.append([c - n + min(j, n - 1) for j in range(width)])
        device = self.positions.device
        tables = self.block_table_tensor()
        if seqs is not None:
            tables = tables[upload(torch.tensor(list(seqs), dtype=torch.long), device)]
        found = (
            upload(torch.tensor(index, dtype=torch.long), device),
            upload(torch.tensor(limit, dtype=torch.long), device),
            tables,
        )
        self._padded[key] = found
        return found


def upload(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """Host tensor `t` on `device` (None = where it is): through pinned memory and a
    non-blocking copy on CUDA, since a copy from pageable memory blocks the host."""
    if device is None or torch.device(device) == t.device:
        return t
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _checked_slots(
    slot_mapping: Sequence[int] | torch.Tensor, total: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots to write, as a host tensor, and which of the `total` rows they take (None =
    all): -1 entries dropped, the rest checked to lie in [0, capacity). Plain Python on a
    list: nothing here touches a device."""
    if isinstance(slot_mapping, torch.Tensor):
        shape, slots = tuple(slot_mapping.shape), slot_mapping.reshape(-1).tolist()
    else:
        shape, slots = (len(slot_mapping),), [int(s) for s in slot_mapping]
    if shape != (total,):
        raise ValueError(
            f"slot_mapping has shape {shape}, expected ({total},) = one slot per new token"
        )
    rows = None
    if slots and min(slots) < 0:
        if min(slots) < -1:
            raise IndexError(f"slot {min(slots)} is negative (only -1 = skip is allowed)")
        rows = [i for i, s in enumerate(slots) if s >= 0]
        slots = [slots[i] for i in rows]
    if slots and max(slots) >= capacity:
        raise IndexError(f"write to slot {max(slots)} is past the cache's {capacity} slots")
    as_tensor = torch.tensor(slots, dtype=torch.int64)
    return as_tensor, None if rows is None else torch.tensor(rows, dtype=torch.int64)


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
