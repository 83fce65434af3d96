"""What attention needs to know about one forward pass, passed explicitly (never a global).

A forward runs on a flattened variable-length batch: the new tokens of every sequence are
concatenated into one [T, ...] tensor. Sequence i contributes `query_lens[i]` new tokens and,
after this step, holds `context_lens[i]` tokens of KV in total (cached + new); its new tokens sit
at positions `context_lens[i] - query_lens[i] ... context_lens[i] - 1`. That one convention
covers prefill (cached 0), prefill after a prefix-cache hit or in chunks (cached > 0, many new
tokens) and decode (one new token). With a KV cache, the new K/V go to `slot_mapping` (flat
slot = block_id * block_size + offset; -1 = do not store) and each sequence's whole context is
read back through its block table. Without one, every sequence must be entirely new
(context_len == query_len). Every index is built and checked on the host (`HostBatch`), then
moved in one copy with the step's other indices (`AttentionContext.staged`, patrl.rollout
.staging): no layer reads a device tensor back.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

import patrl.rollout.staging as step_staging
from patrl.rollout.staging import Array, StepStaging, stage_once


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
class HostBatch:
    """A forward's attention layout on the host, checked by `check`: what `AttentionContext`
    stages to the device in one copy (`arrays`)."""

    query_lens: list[int]
    context_lens: list[int]
    slots: list[int] | None = None  # the slots written, each in [0, kv_cache.capacity_tokens)
    write_rows: list[int] | None = None  # the rows they take (-1 slots dropped); None = all
    block_tables: list[list[int]] | None = None
    kv_cache: KVCache | None = None

    @classmethod
    def check(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int] | None = None,
        *,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
        block_tables: Sequence[Sequence[int]] | None = None,
        kv_cache: KVCache | None = None,
    ) -> HostBatch:
        """Check the lengths, and `slot_mapping` (-1 = do not store) against the cache's
        capacity, here on the host, so the layers can write without checks; `context_lens`
        defaults to `query_lens` (no cache)."""
        q_lens = [int(n) for n in query_lens]
        ctx_lens = q_lens if context_lens is None else [int(n) for n in context_lens]
        _check_lengths(q_lens, ctx_lens)
        if kv_cache is None:
            if ctx_lens != q_lens:
                raise ValueError(
                    f"without a kv_cache every token must be new: context_lens {ctx_lens} != "
                    f"query_lens {q_lens}"
                )
            tables = None if block_tables is None else [list(b) for b in block_tables]
            return cls(q_lens, ctx_lens, block_tables=tables)
        if slot_mapping is None or block_tables is None:
            raise ValueError("a kv_cache needs both slot_mapping and block_tables")
        slots, rows = _checked_slots(slot_mapping, sum(q_lens), kv_cache.capacity_tokens)
        if len(block_tables) != len(q_lens):
            raise ValueError(f"{len(block_tables)} block tables for {len(q_lens)} sequences")
        return cls(q_lens, ctx_lens, slots, rows, [list(b) for b in block_tables], kv_cache)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    def table_width(self) -> int:
        """The longest block table (0 without tables)."""
        return max((len(b) for b in self.block_tables or ()), default=0)

    def last_rows(self) -> list[int]:
        """Row of each sequence's last new token in the flattened batch."""
        return [n - 1 for n in itertools.accumulate(self.query_lens)]

    def positions(self) -> list[int] | np.ndarray:
        """The rotary position of every new token: context_len - query_len + j."""
        if self.max_query_len == 1:
            return [c - 1 for c in self.context_lens]
        q = np.array(self.query_lens, dtype=np.int64)
        ctx = np.array(self.context_lens, dtype=np.int64)
        first_row = np.cumsum(q) - q
        return np.arange(int(q.sum()), dtype=np.int64) + np.repeat(ctx - q - first_row, q)

    def arrays(self) -> list[Array]:
        """What `AttentionContext.staged` moves: positions [T] int64, cu_seqlens_q and
        cu_seqlens_k [B + 1] int32, context lengths [B] int32; with a cache, the slots [W]
        int64, the written rows [W] int64 when some are dropped, and the block tables [B,
        max_blocks] int32, zero-padded."""
        b = self.num_seqs
        out = [
            Array(self.positions(), torch.int64, (sum(self.query_lens),)),
            Array([0, *itertools.accumulate(self.query_lens)], torch.int32),
            Array([0, *itertools.accumulate(self.context_lens)], torch.int32),
            Array(self.context_lens, torch.int32),
        ]
        if self.slots is not None:
            out.append(Array(self.slots, torch.int64))
            if self.write_rows is not None:
                out.append(Array(self.write_rows, torch.int64))
        if self.block_tables is not None:
            out.append(table_array(self.block_tables, (b, self.table_width())))
        return out


def table_array(tables: Sequence[Sequence[int]], shape: tuple[int, int]) -> Array:
    """Block tables as an int32 array of `shape` [rows, width], each row zero-padded; rows
    past `tables` repeat its first (a CUDA-graph bucket's padding rows)."""

    def fill(dst: np.ndarray) -> None:
        n, width = len(tables), shape[1]
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(lens.sum()))
        real = dst[:n]
        if n and (lens == width).all():
            real[...] = flat.reshape(n, width)
        else:
            real[...] = 0
            real[np.arange(width)[None, :] < lens[:, None]] = flat  # row-major: row by row
        if shape[0] > n:
            dst[n:] = real[:1]

    return Array(fill, torch.int32, shape)


@dataclass(slots=True)
class AttentionContext:
    """Per-forward attention metadata; build it with `AttentionContext.build` (or `staged`)."""

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
    _context_lens_tensor: torch.Tensor | None = field(default=None, repr=False)
    _staging: StepStaging | None = field(default=None, repr=False)  # for lazy layouts
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
        """Check the layout (`HostBatch.check`) and move it to `device` (None = the host)
        with one copy, through a staging of its own."""
        host = HostBatch.check(
            query_lens,
            context_lens,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            kv_cache=kv_cache,
        )
        return cls.staged(host, device=device)[0]

    @classmethod
    def staged(
        cls,
        host: HostBatch,
        staging: StepStaging | None = None,
        extra: Sequence[Array] = (),
        *,
        device: torch.device | str | None = None,
        padded: bool = False,
    ) -> tuple[AttentionContext, list[torch.Tensor]]:
        """The context of `host` on the device, and the caller's `extra` arrays (a step's
        token ids, its rows to sample), all moved by ONE copy through `staging` (None: a
        staging of its own on `device`, None = the host): every tensor is a view of one
        device buffer. With `padded` (a verify step: short queries, which sdpa attends in one
        padded call), `padded_queries()`'s layout of every sequence goes in the same copy
        rather than in one more when a layer first asks for it; it needs block tables."""
        own = host.arrays()
        if padded:
            if host.block_tables is None:
                raise ValueError("a padded query layout needs block tables (a kv_cache)")
            own += _padded_arrays(host.query_lens, host.context_lens, range(host.num_seqs))
        arrays = [*own, *extra]
        if staging is None:
            staging = StepStaging("cpu" if device is None else device, capacity=0)
        tensors = staging.stage(arrays).tensors
        mine, theirs = tensors[: len(own)], tensors[len(own) :]
        positions, cu_q, cu_k, lens, *rest = mine
        slots = rows = table = None
        if host.slots is not None:
            slots, *rest = rest
            if host.write_rows is not None:
                rows, *rest = rest
        found: dict[tuple[int, ...] | None, PaddedQueries] = {}
        if host.block_tables is not None:
            table, *rest = rest
            if padded:
                index, limit = rest
                found[None] = (index, limit, table)
        ctx = cls(
            query_lens=host.query_lens,
            context_lens=host.context_lens,
            positions=positions,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            slot_mapping=slots,
            write_rows=rows,
            block_tables=host.block_tables,
            kv_cache=host.kv_cache,
            _block_table_tensor=table,
            _context_lens_tensor=lens,
            _staging=staging,
            _padded=found,
        )
        return ctx, theirs

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
        """`context_lens` as a [B] int32 tensor on the device: staged with the context, else
        (a context made field by field) from `cu_seqlens_k`."""
        if self._context_lens_tensor is None:
            self._context_lens_tensor = self.cu_seqlens_k[1:] - self.cu_seqlens_k[:-1]
        return self._context_lens_tensor

    def last_token_indices(self) -> torch.Tensor:
        """Row of each sequence's last new token in the flattened batch (the one to sample)."""
        return (self.cu_seqlens_q[1:] - 1).long()

    def block_table_tensor(self) -> torch.Tensor:
        """Block tables as an int32 [B, max_blocks] tensor, zero-padded (for fused kernels)."""
        if self._block_table_tensor is None:
            if self.block_tables is None:
                raise ValueError("this context has no block tables")
            width = max(len(b) for b in self.block_tables)
            array = table_array(self.block_tables, (len(self.block_tables), width))
            (self._block_table_tensor,) = self._stage([array])
        return self._block_table_tensor

    def _stage(self, arrays: Sequence[Array]) -> list[torch.Tensor]:
        """Arrays built after the forward's one copy, in one more copy: through the staging
        the context came from (its other buffer), else one of their own."""
        if self._staging is not None:
            return self._staging.stage(arrays).tensors
        return stage_once(arrays, self.positions.device)

    def padded_queries(self, seqs: Sequence[int] | None = None) -> PaddedQueries:
        """The layout of sequences `seqs` (None = all; their queries taken in order) with their
        queries padded to the longest, Qmax, for one batched attention call:
        - index [T] int64: the padded row (b * Qmax + j) of each of their T query tokens;
        - limit [B, Qmax] int64: the last key position row (b, j) may see, L - Q + j for
          query j of a sequence with Q new tokens and context L, and L - 1 on padding rows;
        - their block tables, [B, max_blocks] int32.
        Built on the host from `query_lens` and `context_lens`, moved in one copy and kept for
        the forward's other layers."""
        key = None if seqs is None else tuple(seqs)
        found = self._padded.get(key)
        if found is not None:
            return found
        chosen = range(self.num_seqs) if seqs is None else seqs
        arrays = _padded_arrays(self.query_lens, self.context_lens, chosen)
        if seqs is not None:  # their rows of the block tables, in the same copy
            assert self.block_tables is not None
            rows = [self.block_tables[i] for i in seqs]
            arrays.append(table_array(rows, (len(rows), max(len(b) for b in self.block_tables))))
        staged = self._stage(arrays)
        tables = self.block_table_tensor() if seqs is None else staged[2]
        found = (staged[0], staged[1], tables)
        self._padded[key] = found
        return found


def _padded_arrays(
    query_lens: Sequence[int], context_lens: Sequence[int], chosen: Sequence[int]
) -> list[Array]:
    """`AttentionContext.padded_queries`' index [T] and limit [B, Qmax] of sequences
    `chosen`, as arrays to stage."""
    width = max(query_lens[i] for i in chosen)
    index: list[int] = []
    limit: list[list[int]] = []
    for b, i in enumerate(chosen):
        n, c = query_lens[i], context_lens[i]
        index += range(b * width, b * width + n)
        limit.append([c - n + min(j, n - 1) for j in range(width)])
    return [Array(index, torch.int64), Array(limit, torch.int64, (len(chosen), width))]


def upload(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """Host tensor `t` on `device` (None = where it is): through pinned memory and a
    non-blocking copy on CUDA, since a copy from pageable memory blocks the host; through
    `staging.move`, which counts it, on CPU too (where `t` itself comes back). A step's own
    indices go up together (`AttentionContext.staged`); this is for the odd one."""
    if device is None:
        return t
    device = torch.device(device)
    if device == t.device and device.type != "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return step_staging.move(t, device)


def _checked_slots(
    slot_mapping: Sequence[int] | torch.Tensor, total: int, capacity: int
) -> tuple[list[int], list[int] | None]:
    """The slots to write and which of the `total` rows they take (None = all): -1 entries
    dropped, the rest checked to lie in [0, capacity). Plain Python on a list: nothing here
    touches a device."""
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
    return slots, rows


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
