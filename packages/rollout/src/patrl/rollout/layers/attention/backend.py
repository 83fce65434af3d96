"""The attention backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from patrl.rollout.layers.attention.context import AttentionContext, HostBatch


class AttentionBackend(ABC):
    """Causal self-attention of a varlen batch against each sequence's cached context."""

    name: ClassVar[str]

    def wants_padded_queries(self, host: HostBatch) -> bool:
        """Whether a forward over `host` reads `AttentionContext.padded_queries()` (every
        sequence's padded layout): then the step stages that layout with its context's one
        copy (`AttentionContext.staged(padded=True)`) instead of a layer staging it in a copy
        of its own. False unless a backend says so."""
        return False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """Attend the new tokens' queries; return [T, q_heads, head_dim].

        q [T, q_heads, D] and k, v [T, kv_heads, D] are the new tokens' (rotated) projections,
        q_heads a multiple of kv_heads (GQA). With `ctx.kv_cache`, k and v are first stored
        at `ctx.slot_mapping`, then every sequence attends to its whole context. The mask is
        causal aligned to the lower right: query j of a sequence with Q new tokens and context
        L sees keys 0 .. L - Q + j. The softmax scale is 1 / sqrt(D).
        """
