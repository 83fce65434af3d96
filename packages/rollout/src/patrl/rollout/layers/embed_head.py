"""Vocabulary-parallel token embedding and LM head.

Each rank holds `ceil(vocab / tp)` rows (tpreshard's vocab spec). The embedding looks up only
the ids it owns and all-reduces; the head computes its logit columns and all-gathers them, so
every TP rank holds the full logits and samples identically.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from patrl.rollout.layers.sharded import ShardedModule
from patrl.tpreshard import ParallelLayout, ShardSpec, tp_all_gather, tp_all_reduce, vocab_range


class VocabParallelEmbedding(ShardedModule):
    # The head's weight is a matmul weight (input-major on CPU); the table is looked up by row.
    is_head = False

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        layout: ParallelLayout,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(layout)
        self.vocab_size = vocab_size
        self.weight = self.add_param(
            "weight",
            (vocab_size, hidden_size),
            ShardSpec.vocab(),
            dtype,
            device,
            matmul_weight=self.is_head,
        )

    @property
    def vocab_start(self) -> int:
        return vocab_range(self.vocab_size, self.layout.tp_rank, self.layout.tp_size)[0]

    @property
    def vocab_end(self) -> int:
        return vocab_range(self.vocab_size, self.layout.tp_rank, self.layout.tp_size)[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.layout.tp_size == 1:
            return F.embedding(ids, self.weight)
        owned = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(owned, ids - self.vocab_start, 0)
        y = F.embedding(local, self.weight).masked_fill_(~owned.unsqueeze(-1), 0)
        return tp_all_reduce(self.layout, y)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> full-vocabulary logits on every TP rank (weight may be tied to the embedding)."""

    is_head = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(F.linear(hidden, self.weight))

    def local(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """This rank's logit columns of `hidden` [N, hidden], written into `out` [N, columns]
        (a buffer kept across steps: `ModelRunner._logits_and_samples`)."""
        return torch.mm(hidden, self.weight.t(), out=out)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's logit columns side by side: the full-vocabulary logits."""
        logits = tp_all_gather(self.layout, local, dim=-1)
        # Drop the padding rows of the last rank's vocabulary block.
        return logits[..., : self.vocab_size]
