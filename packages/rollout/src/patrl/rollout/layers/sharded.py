"""A module whose parameters know how they are cut across the TP group.

Every parameter carries `shard_spec` (a tpreshard `ShardSpec` describing its full tensor) and
`weight_loader(param, full_tensor, shard_id=None)`, so loading a checkpoint at any TP size is one
loop over the checkpoint's tensors, and weight sync from the trainer is the same loop.
"""

from __future__ import annotations

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
    ) -> nn.Parameter:
        """Register `name` with this rank's local shape of a `full_shape` tensor cut by `spec`."""
        local = spec.local_shape(full_shape, self.layout.tp_size)
        param = nn.Parameter(torch.empty(local, dtype=dtype, device=device), requires_grad=False)
        param.shard_spec = spec  # type: ignore[attr-defined]
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.register_parameter(name, param)
        return param

    def weight_loader(
        self, param: nn.Parameter, full: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """Copy this rank's cut of the full checkpoint tensor (or one fused part) into `param`."""
        load_full(param, full, param.shard_spec, self.layout, part=shard_id)  # type: ignore[attr-defined]
