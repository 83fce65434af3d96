"""SwiGLU's activation on a fused gate|up tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2n] (gate | up) -> silu(gate) * up, [..., n]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
