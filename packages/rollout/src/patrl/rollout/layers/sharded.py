"""A module whose parameters know how they are cut across the TP group.

Every parameter carries `shard_spec` (a tpreshard `ShardSpec` of its full tensor) and
`weight_loader(param, full_tensor, shard_id=None)`, so loading a checkpoint at any TP size, and
weight sync, is one loop over full tensors. The loader is bound to a weak proxy of its module:
a bound method would make a reference cycle, and a dropped model would hold its memory until
the cyclic collector ran. Linear weights on the CPU are stored input-major (the [out, in]
parameter is a transposed view of a contiguous [in, out] tensor), which MKL streams faster at
the few rows of a shrinking decode batch; loading, resharding and sync see only the view.
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
