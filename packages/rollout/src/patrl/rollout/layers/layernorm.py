"""RMSNorm, computed in fp32 and cast back like Hugging Face's, so logits match at fp32 and bf16."""

from __future__ import annotations

import torch

from patrl.rollout.layers.sharded import ShardedModule
from patrl.tpreshard import ParallelLayout, ShardSpec


class RMSNorm(ShardedModule):
    def __init__(
        self,
        size: int,
        eps: float,
        layout: ParallelLayout,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(layout)
        self.eps = eps
        self.weight = self.add_param("weight", (size,), ShardSpec.replicated(), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
