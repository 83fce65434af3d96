"""A module whose parameters know how they are cut across the TP group.

Every parameter carries `shard_spec` (a tpreshard `ShardSpec` describing its full tensor) and
`weight_loader(param, full_tensor, shard_id=None)`, so loading a checkpoint at any TP size is one
loop over the checkpoint's tensors, and weight sync from the trainer is the same loop. The loader
is bound to a weak proxy of its module: a bound method would make module -> parameter -> method
-> module a reference cycle, and a dropped model (the engine rebuilds one at every weight sync
after an adaptive rollout) would then hold its memory until Python's cyclic collector happened
to run (measured: 0.6-1.2 GB more per sync of a 302M model).

Linear weights on the CPU are stored input-major: the parameter has its usual [out, in] shape,
but as the transposed view of a contiguous [in, out] tensor. MKL's fp32 matmul streams such a
weight 1.5-1.7x faster at 1-2 rows (the decode of a shrinking batch, measured on a 2-core
x86 box: 12 GB/s [out, in] vs 17-19 GB/s [in, out] for a 4096x768 and a 32000x768 weight;
batch-1 decode of a 134M Llama 54 -> 42 ms) and about as fast from 4 rows on. The price is
paid at weight sync: copying a row-major tensor in transposes it (0.1 -> 0.4 s for the 134M
model). Loading, resharding and weight sync see only the [out, in] view.
"""

from __future__ import annotations

import types
import weakref

import torch
from torch import nn

from patrl.tpreshard import ParallelLayout, ShardSpec, load_full


class ShardedModule(nn.Module):
    """Base of the TP layers: holds the layout and creates self-loading parameters."""

    def __init__(self, layout: ParallelLayout) -> None:
        super().__init__()
        self.layout = layout

    def add_param(
        self,
        name: str,
        full_shape: tuple[int, ...],
        spec: ShardSpec,
        dtype: torch.dtype,
        device: torch.device | str | None,
        *,
        matmul_weight: bool = False,
    ) -> nn.Parameter:
        """Register `name` with this rank's local shape of a `full_shape` tensor cut by `spec`.
        A `matmul_weight` (the [out, in] weight of a linear map) is stored input-major on CPU."""
        local = spec.local_shape(full_shape, self.layout.tp_size)
        input_major = matmul_weight and torch.device(device or "cpu").type == "cpu"
        data = (
            torch.empty(local[::-1], dtype=dtype, device=device).t()
            if input_major
            else torch.empty(local, dtype=dtype, device=device)
        )
        param = nn.Parameter(data, requires_grad=False)
        param.shard_spec = spec  # type: ignore[attr-defined]
        loader = types.MethodType(type(self).weight_loader, weakref.proxy(self))
        param.weight_loader = loader  # type: ignore[attr-defined]
        self.register_parameter(name, param)
        return param

    def weight_loader(
        self, param: nn.Parameter, full: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """Copy this rank's cut of the full checkpoint tensor (or one fused part) into `param`."""
        load_full(param, full, param.shard_spec, self.layout, part=shard_id)  # type: ignore[attr-defined]
