"""One sequence's KV, contiguous and detached from any cache: the unit of migration."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SequenceKV:
    """K and V of a sequence's computed tokens, `[num_layers, num_computed, heads, head_dim]`.

    `token_ids` may run past the computed KV (tokens that have a slot but were not yet run
    through the model); an importer gives them slots and leaves them to be computed.
    `head_start`/`num_total_kv_heads` say which of the model's KV heads this holds, so a
    resharder can check it is importing the slice it expects.

    `first` > 0: rows `[0, first)` of k and v were not filled in (a migration sent them once
    for several samples of one prompt); an importer takes them from its prefix cache, and
    `PagedKVCache.can_import` is False where that cache does not hold them.
    """

    token_ids: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor
    head_start: int
    num_total_kv_heads: int
    first: int = 0

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(
                f"SequenceKV k and v must both be [layers, tokens, heads, head_dim]; got "
                f"{tuple(self.k.shape)} and {tuple(self.v.shape)}"
            )
        if self.k.dtype != self.v.dtype:
            raise ValueError(f"SequenceKV k dtype {self.k.dtype} != v dtype {self.v.dtype}")
        if self.num_computed > len(self.token_ids):
            raise ValueError(
                f"SequenceKV has KV for {self.num_computed} tokens but only "
                f"{len(self.token_ids)} token ids"
            )
        if not 0 <= self.head_start < self.head_start + self.num_heads <= self.num_total_kv_heads:
            raise ValueError(
                f"SequenceKV heads [{self.head_start}, {self.head_start + self.num_heads}) do not "
                f"fit in {self.num_total_kv_heads} KV heads"
            )
        if not 0 <= self.first <= self.num_computed:
            raise ValueError(
                f"SequenceKV first={self.first} is not within its {self.num_computed} computed "
                "tokens"
            )

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def num_computed(self) -> int:
        return int(self.k.shape[1])

    @property
    def num_heads(self) -> int:
        return int(self.k.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[3])

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def heads(self, start: int, end: int) -> SequenceKV:
        """Heads `[start, end)` of the model (absolute indices), e.g. one TP rank's share."""
        lo, hi = start - self.head_start, end - self.head_start
        if not 0 <= lo < hi <= self.num_heads:
            raise ValueError(
                f"heads [{start}, {end}) are not within this SequenceKV's heads "
                f"[{self.head_start}, {self.head_start + self.num_heads})"
            )
        return SequenceKV(
            self.token_ids,
            self.k[:, :, lo:hi].contiguous(),
            self.v[:, :, lo:hi].contiguous(),
            start,
            self.num_total_kv_heads,
            self.first,
        )

    @staticmethod
    def concat_heads(parts: list[SequenceKV]) -> SequenceKV:
        """Join head slices of one sequence back together (e.g. when TP shrinks)."""
        if not parts:
            raise ValueError("concat_heads needs at least one SequenceKV")
        parts = sorted(parts, key=lambda p: p.head_start)
        first = parts[0]
        for prev, part in itertools.pairwise(parts):
            if part.head_start != prev.head_start + prev.num_heads:
                raise ValueError(
                    f"head slices are not contiguous: [{prev.head_start}, "
                    f"{prev.head_start + prev.num_heads}) then starts at {part.head_start}"
                )
            if part.token_ids != first.token_ids or part.num_computed != first.num_computed:
                raise ValueError("head slices come from different sequences or lengths")
        return SequenceKV(
            first.token_ids,
            torch.cat([p.k for p in parts], dim=2),
            torch.cat([p.v for p in parts], dim=2),
            first.head_start,
            first.num_total_kv_heads,
            max(p.first for p in parts),
        )
