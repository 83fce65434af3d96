"""Megatron-style linear layers: column-parallel (output split) and row-parallel (input split).

A column layer followed by a row layer needs exactly one all-reduce, in the row layer. Fused
column layers (qkv, gate_up) declare their parts so that each part is cut on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from patrl.rollout.layers.sharded import ShardedModule
from patrl.tpreshard import ParallelLayout, ShardPart, ShardSpec, tp_all_reduce


class ColumnParallelLinear(ShardedModule):
    """y_local = x @ W_local^T: each rank computes its slice of the output features."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        layout: ParallelLayout,
        *,
        bias: bool = False,
        spec: ShardSpec | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(layout)
        spec = spec or ShardSpec.column()
        self.weight = self.add_param(
            "weight", (out_features, in_features), spec, dtype, device, matmul_weight=True
        )
        self.bias = self.add_param("bias", (out_features,), spec, dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers of the same input fused in one matmul (gate_proj | up_proj)."""

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        layout: ParallelLayout,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        spec = ShardSpec.column(*(ShardPart(n, size) for n, size in parts.items()))
        super().__init__(
            in_features,
            sum(parts.values()),
            layout,
            bias=bias,
            spec=spec,
            dtype=dtype,
            device=device,
        )


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v projections fused; kv heads are replicated when fewer than the TP ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        layout: ParallelLayout,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        spec = ShardSpec.qkv(num_heads, num_kv_heads, head_dim)
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, layout, bias=bias, spec=spec, dtype=dtype, device=device)
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads

    # Derived from the layout, so that a reshard only swaps the layout and the parameters.
    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.layout.tp_size

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.layout.tp_size)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, local qkv] -> q [T, heads, D], k and v [T, kv_heads, D] (local heads)."""
        q_size = self.num_local_heads * self.head_dim
        kv_size = self.num_local_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        t = qkv.shape[0]
        return (
            q.reshape(t, self.num_local_heads, self.head_dim),
            k.reshape(t, self.num_local_kv_heads, self.head_dim),
            v.reshape(t, self.num_local_kv_heads, self.head_dim),
        )


class RowParallelLinear(ShardedModule):
    """y = all_reduce(x_local @ W_local^T) + b: the input features are split, the bias is not."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        layout: ParallelLayout,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(layout)
        self.weight = self.add_param(
            "weight",
            (out_features, in_features),
            ShardSpec.row(),
            dtype,
            device,
            matmul_weight=True,
        )
        self.bias = (
            self.add_param("bias", (out_features,), ShardSpec.replicated(), dtype, device)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        tp_all_reduce(self.layout, y)
        # After the reduction, so the bias is counted once and not tp_size times.
        return y if self.bias is None else y + self.bias
