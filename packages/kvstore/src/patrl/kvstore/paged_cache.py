"""The KV tensors behind a BlockManager: write, gather by block table, export and import."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from patrl.kvstore.block_manager import BlockManager
from patrl.kvstore.sequence_kv import SequenceKV
from patrl.kvstore.spec import KVCacheSpec


class PagedKVCache:
    """Per-layer K and V of shape `[num_blocks, block_size, kv_heads, head_dim]`.

    The cache owns its `BlockManager` (`self.blocks`): the bookkeeping and the tensors always
    describe the same blocks. Under tensor parallelism every rank of a group holds the same
    block layout and its own slice of the KV heads, `[head_start, head_start + kv_heads)` of
    the model's `num_total_kv_heads`.

    Every layer's K and V are views of one flat pool, so a cache for another layout can take
    over this one's pool (`reuse=`) instead of allocating and zeroing a new one.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        head_start: int = 0,
        num_total_kv_heads: int | None = None,
        reuse: PagedKVCache | None = None,
    ) -> None:
        """`reuse`: a cache whose contents are no longer needed (e.g. the old layout's, once
        its sequences are exported); its pool is taken over when large enough, else released
        before the new one is allocated. Either way `reuse` is left empty and unusable."""
        self.spec = spec
        self.blocks = BlockManager(num_blocks, spec.block_size, enable_prefix_caching)
        self.head_start = head_start
        self.num_total_kv_heads = num_total_kv_heads or spec.num_kv_heads
        if not 0 <= head_start < head_start + spec.num_kv_heads <= self.num_total_kv_heads:
            raise ValueError(
                f"local KV heads [{head_start}, {head_start + spec.num_kv_heads}) do not fit in "
                f"num_total_kv_heads={self.num_total_kv_heads}"
            )
        self._attach(_take_pool(reuse, self._pool_numel(), spec))

    def _layer_shape(self) -> tuple[int, int, int, int]:
        spec = self.spec
        return (self.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def _pool_numel(self) -> int:
        return 2 * self.spec.num_layers * math.prod(self._layer_shape())

    def _attach(self, pool: torch.Tensor) -> None:
        """Make `pool` (at least `_pool_numel()` elements) this cache's storage."""
        spec, shape, numel = self.spec, self._layer_shape(), self._pool_numel()
        self.pool = pool
        # [k|v, layer, slot, head, dim]: every layer at once, for export and import.
        self._slots = self.pool[:numel].view(2, spec.num_layers, -1, *shape[2:])
        k, v = self.pool[:numel].view(2, spec.num_layers, *shape).unbind(0)
        self.k = list(k.unbind(0))
        self.v = list(v.unbind(0))
        # gather_padded's output on CPU, kept across calls
        self._padded_k = self._padded_v = self.pool.new_empty(0)

    def release(self) -> torch.Tensor:
        """Give up the pool (returned): this cache holds no tensors afterwards."""
        pool = self.pool
        self.pool = self._slots = pool.new_empty(0)
        self._padded_k = self._padded_v = pool.new_empty(0)
        self.k, self.v = [], []
        return pool

    def reallocate(self) -> None:
        """A fresh zeroed pool after `release`, with the prefix cache forgotten (its KV is
        gone): for a cache freed while its engine sleeps. Every block must be free."""
        if self.blocks.num_used_blocks:
            raise RuntimeError(
                f"reallocate() needs every block free; {self.blocks.num_used_blocks} are in use"
            )
        if self.pool.numel():
            raise RuntimeError("reallocate() needs a released cache: this one holds its pool")
        self.blocks.reset_prefix_cache()
        self._attach(
            torch.zeros(self._pool_numel(), dtype=self.spec.dtype, device=self.spec.device)
        )

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V blocks (the pool may be larger when it was taken over)."""
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    # ------------------------------------------------------------- tensor ops

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store K/V rows `[n, kv_heads, head_dim]` at slots `[n]`; slot -1 means skip.

        Checks the slots, reading them on the host (a device sync); `write_slots` is its
        unchecked twin for slots validated when they were built."""
        if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"write: k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping "
                f"{tuple(slot_mapping.shape)} disagree on the number of tokens"
            )
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
        if slot_mapping.numel() and int(slot_mapping.max()) >= self.capacity_tokens:
            raise IndexError(
                f"write to slot {int(slot_mapping.max())} is past the cache's "
                f"{self.capacity_tokens} slots"
            )
        self.write_slots(layer, slot_mapping, k, v)

    def write_slots(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store K/V rows `[n, kv_heads, head_dim]` at `slots` `[n]`, each in
        `[0, capacity_tokens)`: unchecked, so no host sync (the caller validated the slots
        on the host when it built them; an out-of-range slot is undefined behaviour)."""
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        self.k[layer].view(-1, heads, dim).index_copy_(0, slots, k.to(self.spec.dtype))
        self.v[layer].view(-1, heads, dim).index_copy_(0, slots, v.to(self.spec.dtype))

    def gather(
        self, layer: int, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each sequence's first `context_len` K/V rows, `[context_len, kv_heads, head_dim]`."""
        ks, vs = [], []
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        for table, n in zip(block_tables, context_lens, strict=True):
            if n > len(table) * self.spec.block_size:
                raise IndexError(f"context of {n} tokens is longer than its {len(table)} blocks")
            index = _upload(torch.as_tensor(table, dtype=torch.long), self.spec.device)
            ks.append(self.k[layer].index_select(0, index).reshape(-1, heads, dim)[:n])
            vs.append(self.v[layer].index_select(0, index).reshape(-1, heads, dim)[:n])
        return ks, vs

    def gather_padded(
        self, layer: int, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V for a batch, `[batch, max_blocks * block_size, kv_heads, head_dim]`.

        `block_tables` is `[batch, max_blocks]`, padded with any valid block id (0): the
        caller masks positions past each sequence's context length.

        On CPU the result is a view of buffers this cache keeps (grown when a batch needs
        more), valid until the next call: fresh tensors that large would be mapped afresh by
        glibc, page faults and all, twice a layer."""
        b = block_tables.shape[0]
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        # index_select on the flat table: cheaper than advanced indexing on CPU
        flat = block_tables.reshape(-1).long()
        if self.k[layer].device.type != "cpu":
            k = self.k[layer].index_select(0, flat)
            v = self.v[layer].index_select(0, flat)
        else:
            if self._padded_k.shape[0] < len(flat):
                # grow by a quarter at least: contexts grow a block at a time
                shape = (max(len(flat), self._padded_k.shape[0] * 5 // 4), *self.k[layer].shape[1:])
                del self._padded_k, self._padded_v  # freed before the larger ones are made
                self._padded_k, self._padded_v = (
                    self.pool.new_empty(shape),
                    self.pool.new_empty(shape),
                )
            k = torch.index_select(self.k[layer], 0, flat, out=self._padded_k[: len(flat)])
            v = torch.index_select(self.v[layer], 0, flat, out=self._padded_v[: len(flat)])
        return k.view(b, -1, heads, dim), v.view(b, -1, heads, dim)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Perform the copy-on-write moves `(src, dst)` that `BlockManager.append` returned."""
        if not copies:
            return
        src = _upload(torch.tensor([s for s, _ in copies], dtype=torch.long), self.spec.device)
        dst = _upload(torch.tensor([d for _, d in copies], dtype=torch.long), self.spec.device)
        for cache in (*self.k, *self.v):
            cache[dst] = cache[src]

    # ------------------------------------------------------- export / import

    def export(self, seq_id: Hashable) -> SequenceKV:
        """A contiguous copy of a sequence's computed KV, with its token ids: one gather of
        its slots over every layer (per-layer gathers, a stack and a clone copied it 3 times)."""
        index = self._slot_index(seq_id, 0, self.blocks.num_computed(seq_id))
        return SequenceKV(
            tuple(self.blocks.token_ids(seq_id)),
            self._slots[0].index_select(1, index),
            self._slots[1].index_select(1, index),
            self.head_start,
            self.num_total_kv_heads,
        )

    def can_import(self, kv: SequenceKV) -> bool:
        """Whether `import_` would succeed now: blocks enough, and for KV sent without its
        first `kv.first` tokens, those tokens in the prefix cache."""
        if kv.first and self.blocks.num_cached_prefix(kv.token_ids) < kv.first:
            return False
        return self.blocks.can_allocate(kv.token_ids)

    def import_(self, seq_id: Hashable, kv: SequenceKV) -> None:
        """Allocate a sequence for `kv.token_ids` and fill in its computed KV.

        Works across block sizes. The KV must carry exactly this cache's heads: slice it with
        `kv.heads(...)` first when moving between TP layouts.
        """
        self._check_importable(kv)
        if kv.first and self.blocks.num_cached_prefix(kv.token_ids) < kv.first:
            raise ValueError(
                f"sequence {seq_id!r}: its KV starts at token {kv.first} and this cache holds "
                f"only {self.blocks.num_cached_prefix(kv.token_ids)} of its first tokens; "
                "check can_import first"
            )
        if not self.blocks.can_allocate(kv.token_ids):
            raise RuntimeError(
                f"not enough free KV blocks to import sequence {seq_id!r} "
                f"({len(kv.token_ids)} tokens, {self.blocks.num_free_blocks} blocks free); "
                "check can_import first"
            )
        cached = self.blocks.allocate(seq_id, kv.token_ids)
        start = min(cached, kv.num_computed)
        if kv.num_computed > start:
            index = self._slot_index(seq_id, start, kv.num_computed)
            self._slots[0].index_copy_(1, index, kv.k[:, start:])  # every layer at once
            self._slots[1].index_copy_(1, index, kv.v[:, start:])
        self.blocks.mark_computed(seq_id, max(0, kv.num_computed - cached))

    def _slot_index(self, seq_id: Hashable, start: int, end: int) -> torch.Tensor:
        """BlockManager.slot_mapping as a tensor, computed per block rather than per token."""
        bs = self.spec.block_size
        table = torch.as_tensor(self.blocks.block_table(seq_id), dtype=torch.long)
        slots = (table[:, None] * bs + torch.arange(bs)).flatten()
        if not 0 <= start <= end <= len(self.blocks.token_ids(seq_id)):
            self.blocks.slot_mapping(seq_id, start, end)  # raises, naming the range
        return slots[start:end].to(self.spec.device)

    def _check_importable(self, kv: SequenceKV) -> None:
        spec = self.spec
        for name, mine, theirs in (
            ("num_layers", spec.num_layers, kv.num_layers),
            ("head_dim", spec.head_dim, kv.head_dim),
            ("dtype", spec.dtype, kv.k.dtype),
            ("num_total_kv_heads", self.num_total_kv_heads, kv.num_total_kv_heads),
        ):
            if mine != theirs:
                raise ValueError(
                    f"cannot import KV with {name}={theirs}: this cache has {name}={mine}"
                )
        if (kv.head_start, kv.num_heads) != (self.head_start, spec.num_kv_heads):
            raise ValueError(
                f"cannot import KV heads [{kv.head_start}, {kv.head_start + kv.num_heads}): this "
                f"cache holds heads [{self.head_start}, {self.head_start + spec.num_kv_heads}); "
                "slice with SequenceKV.heads() first"
            )


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`: pinned and non-blocking on CUDA, where a copy from
    pageable memory blocks the host."""
    if device == t.device:
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _take_pool(reuse: PagedKVCache | None, numel: int, spec: KVCacheSpec) -> torch.Tensor:
    """A flat pool of at least `numel` elements: `reuse`'s when it fits, else fresh zeros.

    Zeros, not empty: gathered padding is masked out of attention, but 0 * NaN is NaN. A
    taken-over pool needs no zeroing: it holds zeros and KV the model wrote, all finite, the
    stale contents a freed block already hands to its next sequence, and an unwritten slot is
    only ever read as masked padding. Skipping the zeroing skips touching every page of a new
    pool, and the old pool is never alive beside a new one."""
    if reuse is not None:
        pool = reuse.release()
        if pool.dtype == spec.dtype and pool.device == spec.device and pool.numel() >= numel:
            return pool
        del pool  # released before the new pool is allocated: one pool alive at a time
    return torch.zeros(numel, dtype=spec.dtype, device=spec.device)
