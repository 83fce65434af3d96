"""The KV tensors behind a BlockManager: write, gather by block table, export and import."""

from __future__ import annotations

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
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        head_start: int = 0,
        num_total_kv_heads: int | None = None,
    ) -> None:
        self.spec = spec
        self.blocks = BlockManager(num_blocks, spec.block_size, enable_prefix_caching)
        self.head_start = head_start
        self.num_total_kv_heads = num_total_kv_heads or spec.num_kv_heads
        if not 0 <= head_start < head_start + spec.num_kv_heads <= self.num_total_kv_heads:
            raise ValueError(
                f"local KV heads [{head_start}, {head_start + spec.num_kv_heads}) do not fit in "
                f"num_total_kv_heads={self.num_total_kv_heads}"
            )
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # Zeros, not empty: gathered padding is masked out of attention, but 0 * NaN is NaN.
        self.k = [
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    # ------------------------------------------------------------- tensor ops

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store K/V rows `[n, kv_heads, head_dim]` at slots `[n]`; slot -1 means skip."""
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
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        self.k[layer].view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(self.spec.dtype))
        self.v[layer].view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(self.spec.dtype))

    def gather(
        self, layer: int, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each sequence's first `context_len` K/V rows, `[context_len, kv_heads, head_dim]`."""
        ks, vs = [], []
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        for table, n in zip(block_tables, context_lens, strict=True):
            if n > len(table) * self.spec.block_size:
                raise IndexError(f"context of {n} tokens is longer than its {len(table)} blocks")
            index = torch.as_tensor(table, dtype=torch.long, device=self.spec.device)
            ks.append(self.k[layer].index_select(0, index).reshape(-1, heads, dim)[:n])
            vs.append(self.v[layer].index_select(0, index).reshape(-1, heads, dim)[:n])
        return ks, vs

    def gather_padded(
        self, layer: int, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V for a batch, `[batch, max_blocks * block_size, kv_heads, head_dim]`.

        `block_tables` is `[batch, max_blocks]`, padded with any valid block id (0): the
        caller masks positions past each sequence's context length.
        """
        b = block_tables.shape[0]
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        # index_select on the flat table is 3-6x faster than advanced indexing on CPU.
        flat = block_tables.reshape(-1).long()
        k = self.k[layer].index_select(0, flat).reshape(b, -1, heads, dim)
        v = self.v[layer].index_select(0, flat).reshape(b, -1, heads, dim)
        return k, v

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Perform the copy-on-write moves `(src, dst)` that `BlockManager.append` returned."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.spec.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.spec.device)
        for cache in (*self.k, *self.v):
            cache[dst] = cache[src]

    # ------------------------------------------------------- export / import

    def export(self, seq_id: Hashable) -> SequenceKV:
        """A contiguous copy of a sequence's computed KV, with its token ids."""
        table = self.blocks.block_table(seq_id)
        n = self.blocks.num_computed(seq_id)
        ks, vs = [], []
        for layer in range(self.spec.num_layers):
            k, v = self.gather(layer, [table], [n])
            ks.append(k[0])
            vs.append(v[0])
        return SequenceKV(
            tuple(self.blocks.token_ids(seq_id)),
            torch.stack(ks).clone(),
            torch.stack(vs).clone(),
            self.head_start,
            self.num_total_kv_heads,
        )

    def can_import(self, kv: SequenceKV) -> bool:
        return self.blocks.can_allocate(kv.token_ids)

    def import_(self, seq_id: Hashable, kv: SequenceKV) -> None:
        """Allocate a sequence for `kv.token_ids` and fill in its computed KV.

        Works across block sizes. The KV must carry exactly this cache's heads: slice it with
        `kv.heads(...)` first when moving between TP layouts.
        """
        self._check_importable(kv)
        if not self.can_import(kv):
            raise RuntimeError(
                f"not enough free KV blocks to import sequence {seq_id!r} "
                f"({len(kv.token_ids)} tokens, {self.blocks.num_free_blocks} blocks free); "
                "check can_import first"
            )
        cached = self.blocks.allocate(seq_id, kv.token_ids)
        start = min(cached, kv.num_computed)
        if kv.num_computed > start:
            slots = self.blocks.slot_mapping(seq_id, start, kv.num_computed)
            index = torch.as_tensor(slots, dtype=torch.long, device=self.spec.device)
            for layer in range(self.spec.num_layers):
                self.write(layer, index, kv.k[layer, start:], kv.v[layer, start:])
        self.blocks.mark_computed(seq_id, max(0, kv.num_computed - cached))

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
