"""What one paged KV cache holds, and what it costs in bytes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of the KV cache held by one rank.

    `num_kv_heads` is the number of KV heads this rank holds (after tensor-parallel sharding),
    not the model's total.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(
                f"KVCacheSpec.dtype must be a floating torch.dtype, got {self.dtype!r}"
            )
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks_for(self, memory_bytes: int) -> int:
        """How many whole blocks fit in `memory_bytes`."""
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
        return memory_bytes // self.bytes_per_block

    def with_heads(self, num_kv_heads: int) -> KVCacheSpec:
        """The same cache for another number of local KV heads (another TP layout)."""
        return KVCacheSpec(
            self.num_layers, num_kv_heads, self.head_dim, self.block_size, self.dtype, self.device
        )
