"""Megatron-style linear layers: column-parallel (output split) and row-parallel (input split).

A column layer followed by a row layer needs exactly one all-reduce, in the row layer. Fused
column layers (qkv, gate_up) declare their parts so that each part is cut on its own.

LoRA (`enable_lora`): y = base(x) + alpha / r * B(A(x)), PEFT's math, each adapter cut as its
base is. Column layer: B ([out, r]) is split on its output rows exactly as the weight (same
spec, same fused parts), A ([P * r, in], one r-row block per fused part) is replicated, so each
rank adds its own rows of the update and nothing is communicated. Row layer: A ([r, in]) is
split on its input dim as the weight; B ([out, r]) is replicated; B(A_local x_local) is a
partial sum that joins the base's partial product before its one all-reduce (B is linear).
The adapters start at zero (no update) and are loaded by `load_weights` like any parameter.
Merged mode folds the update into the weight and keeps the weight it replaced, so unmerging
restores it bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from patrl.rollout.layers.sharded import ShardedModule
from patrl.tpreshard import ParallelLayout, ShardPart, ShardSpec, tp_all_reduce


class _Lora(ShardedModule):
    """The LoRA state both linear kinds share; `enable_lora` is the kind's own."""

    weight: torch.nn.Parameter
    lora_A: torch.nn.Parameter | None
    lora_B: torch.nn.Parameter | None

    def __init__(self, layout: ParallelLayout) -> None:
        super().__init__(layout)
        # Registered empty, so that enable_lora may register them later.
        self.register_parameter("lora_A", None)
        self.register_parameter("lora_B", None)
        self.lora_rank = 0
        self.lora_scaling = 0.0
        # The base weight the merged update replaced (None: not merged).
        self.lora_saved: torch.Tensor | None = None

    def _lora_params(
        self, rank: int, scaling: float, a: tuple[tuple[int, int], ShardSpec],
        b: tuple[tuple[int, int], ShardSpec],
    ) -> None:  # fmt: skip
        if rank <= 0:
            raise ValueError(f"lora_rank must be > 0, got {rank}")
        dtype, device = self.weight.dtype, self.weight.device
        self.lora_rank, self.lora_scaling = rank, scaling
        self.lora_A = self.add_param("lora_A", a[0], a[1], dtype, device)
        self.lora_B = self.add_param("lora_B", b[0], b[1], dtype, device)
        with torch.no_grad():
            self.lora_A.zero_()
            self.lora_B.zero_()

    @property
    def lora_active(self) -> bool:
        """Whether the forward adds the low-rank product (enabled and not merged)."""
        return self.lora_A is not None and self.lora_saved is None

    def lora_delta_weight(self) -> torch.Tensor:
        """alpha / r * B @ A of this rank's cut, [local out, local in], in fp32."""
        raise NotImplementedError

    @torch.no_grad()
    def merge_lora(self) -> None:
        """Fold the update into the weight; keep the weight it replaced (for `unmerge_lora`)."""
        if self.lora_A is None or self.lora_saved is not None:
            return
        self.lora_saved = self.weight.detach().clone()
        self.weight.copy_((self.weight.float() + self.lora_delta_weight()).to(self.weight.dtype))

    @torch.no_grad()
    def unmerge_lora(self) -> None:
        """Put back the weight `merge_lora` replaced, bit for bit."""
        if self.lora_saved is None:
            return
        self.weight.copy_(self.lora_saved)
        self.lora_saved = None


class ColumnParallelLinear(_Lora):
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
        self.in_features, self.out_features = in_features, out_features
        self.weight = self.add_param(
            "weight", (out_features, in_features), spec, dtype, device, matmul_weight=True
        )
        self.bias = self.add_param("bias", (out_features,), spec, dtype, device) if bias else None

    def enable_lora(self, rank: int, scaling: float) -> None:
        """Adapters of rank `rank`: A replicated (one r-row block per fused part, so each part
        has its own A as in the unfused model), B cut as the weight."""
        spec: ShardSpec = self.weight.shard_spec  # type: ignore[attr-defined]
        if spec.parts:
            # num_heads=1: a part of one "head", kept whole on every rank (replicated).
            a_spec = ShardSpec.column(*(ShardPart(p.name, rank, num_heads=1) for p in spec.parts))
            a_rows = rank * len(spec.parts)
        else:
            a_spec, a_rows = ShardSpec.replicated(), rank
        self._lora_params(
            rank, scaling, ((a_rows, self.in_features), a_spec), ((self.out_features, rank), spec)
        )

    def _lora_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(A block, local B rows) of each fused part (one pair when unfused)."""
        assert self.lora_A is not None and self.lora_B is not None
        spec: ShardSpec = self.weight.shard_spec  # type: ignore[attr-defined]
        if not spec.parts:
            return [(self.lora_A, self.lora_B)]
        sizes = [p.local_size(self.layout.tp_size) for p in spec.parts]
        return list(zip(self.lora_A.split(self.lora_rank), self.lora_B.split(sizes), strict=True))

    def lora_delta_weight(self) -> torch.Tensor:
        return torch.cat([b.float() @ a.float() for a, b in self._lora_pairs()]) * self.lora_scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.lora_active:
            return y
        assert self.lora_A is not None
        xa = F.linear(x, self.lora_A)
        pairs = self._lora_pairs()
        if len(pairs) == 1:
            return y + self.lora_scaling * F.linear(xa, pairs[0][1])
        blocks = xa.split(self.lora_rank, dim=-1)
        delta = torch.cat([F.linear(h, b) for h, (_, b) in zip(blocks, pairs, strict=True)], -1)
        return y + self.lora_scaling * delta


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


class RowParallelLinear(_Lora):
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
        self.in_features, self.out_features = in_features, out_features
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

    def enable_lora(self, rank: int, scaling: float) -> None:
        """Adapters of rank `rank`: A cut on its input dim as the weight, B replicated."""
        self._lora_params(
            rank,
            scaling,
            ((rank, self.in_features), ShardSpec.row()),
            ((self.out_features, rank), ShardSpec.replicated()),
        )

    def lora_delta_weight(self) -> torch.Tensor:
        assert self.lora_A is not None and self.lora_B is not None
        return (self.lora_B.float() @ self.lora_A.float()) * self.lora_scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora_active:
            assert self.lora_A is not None and self.lora_B is not None
            # This rank's partial sum of B(A x), reduced with the base's in the one all-reduce.
            y = y + self.lora_scaling * F.linear(F.linear(x, self.lora_A), self.lora_B)
        tp_all_reduce(self.layout, y)
        # After the reduction, so the bias is counted once and not tp_size times.
        return y if self.bias is None else y + self.bias
