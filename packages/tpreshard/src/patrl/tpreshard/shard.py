"""How one parameter is cut across the ranks of a tensor-parallel group (`ShardSpec`).

A spec describes the *full* tensor and its split; local shapes derive from it, so one spec
serves every TP size. Fused parameters (qkv, gate_up) are split part by part and re-fused
(cutting the fused tensor would hand rank 0 all of q). KV heads are *replicated* when the group
has more ranks than heads: rank r takes head `r * num_heads // tp_size` (needs
`tp_size % num_heads == 0`). Vocabulary dimensions split in blocks of `ceil(vocab / tp_size)`
rows, the last zero-padded past the real vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from patrl.tpreshard.layout import ParallelLayout

__all__ = [
    "ShardKind",
    "ShardPart",
    "ShardSpec",
    "head_range",
    "load_full",
    "shard_part",
    "shard_tensor",
    "vocab_range",
]

ShardKind = Literal["replicated", "column", "row", "vocab"]
_DIM: dict[str, int] = {"column": 0, "row": 1, "vocab": 0}


@dataclass(frozen=True, slots=True)
class ShardPart:
    """One piece of a fused parameter along its shard dimension, in the full tensor."""

    name: str
    size: int
    num_heads: int = 0  # > 0: made of heads, replicated when num_heads < tp_size

    def local_size(self, tp_size: int) -> int:
        if 0 < self.num_heads < tp_size:
            return self.size // self.num_heads
        return self.size // tp_size

    def check(self, tp_size: int) -> None:
        """Raise unless this part can be split across `tp_size` ranks."""
        if self.num_heads > 0:
            if self.size % self.num_heads:
                raise ValueError(
                    f"part {self.name!r}: size {self.size} is not a multiple of its "
                    f"num_heads={self.num_heads}"
                )
            if self.num_heads < tp_size and tp_size % self.num_heads:
                raise ValueError(
                    f"part {self.name!r}: {self.num_heads} heads cannot be replicated over "
                    f"tp_size={tp_size}; tp_size must be a multiple of num_heads when smaller"
                )
            if self.num_heads >= tp_size and self.num_heads % tp_size:
                raise ValueError(
                    f"part {self.name!r}: {self.num_heads} heads cannot be split across "
                    f"tp_size={tp_size}; num_heads must be a multiple of tp_size"
                )
        elif self.size % tp_size:
            raise ValueError(
                f"part {self.name!r}: size {self.size} cannot be split across "
                f"tp_size={tp_size}; it must be a multiple of tp_size"
            )

    def cut(self, full: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's piece of the part's full tensor (a view of `full`)."""
        self.check(tp_size)
        if full.shape[dim] != self.size:
            raise ValueError(
                f"part {self.name!r}: expected size {self.size} along dim {dim}, "
                f"got tensor of shape {tuple(full.shape)}"
            )
        if self.num_heads > 0:
            start, count = head_range(self.num_heads, tp_rank, tp_size)
            head_size = self.size // self.num_heads
            return full.narrow(dim, start * head_size, count * head_size)
        local = self.local_size(tp_size)
        return full.narrow(dim, tp_rank * local, local)


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """How a full parameter is split over a TP group; see the module docstring."""

    kind: ShardKind
    parts: tuple[ShardPart, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("replicated", "column", "row", "vocab"):
            raise ValueError(
                f"ShardSpec kind {self.kind!r} is not one of replicated, column, row, vocab"
            )
        if self.parts and self.kind not in ("column", "row"):
            raise ValueError(f"only column or row specs have parts, got kind {self.kind!r}")
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names):
            raise ValueError(f"part names must be unique, got {names}")

    @classmethod
    def replicated(cls) -> ShardSpec:
        return cls("replicated")

    @classmethod
    def column(cls, *parts: ShardPart) -> ShardSpec:
        return cls("column", parts)

    @classmethod
    def row(cls) -> ShardSpec:
        return cls("row")

    @classmethod
    def vocab(cls) -> ShardSpec:
        return cls("vocab")

    @classmethod
    def qkv(cls, num_heads: int, num_kv_heads: int, head_dim: int) -> ShardSpec:
        """The fused q|k|v projection (weight or bias) of a GQA attention."""
        return cls.column(
            ShardPart("q", num_heads * head_dim, num_heads),
            ShardPart("k", num_kv_heads * head_dim, num_kv_heads),
            ShardPart("v", num_kv_heads * head_dim, num_kv_heads),
        )

    @property
    def dim(self) -> int | None:
        """The split dimension, None when replicated."""
        return _DIM.get(self.kind)

    def part(self, name: str | int) -> ShardPart:
        for i, p in enumerate(self.parts):
            if name in (p.name, i):
                return p
        raise KeyError(f"no part {name!r}; this spec has parts {[p.name for p in self.parts]}")

    def local_shape(self, full_shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
        """The shape one rank holds of a parameter whose full shape is `full_shape`."""
        dim = self.dim
        if dim is None:
            return tuple(full_shape)
        if dim >= len(full_shape):
            raise ValueError(f"{self.kind} spec splits dim {dim}, shape {full_shape} has none")
        shape = list(full_shape)
        if self.kind == "vocab":
            shape[0] = _rows_per_rank(full_shape[0], tp_size)
        elif self.parts:
            self._check_parts_cover(full_shape[dim])
            shape[dim] = sum(p.local_size(tp_size) for p in self.parts)
        else:
            ShardPart(self.kind, full_shape[dim]).check(tp_size)
            shape[dim] = full_shape[dim] // tp_size
        return tuple(shape)

    def part_offset(self, name: str | int, tp_size: int) -> int:
        """Where part `name` starts in the local tensor, along the split dimension."""
        target = self.part(name)
        offset = 0
        for p in self.parts:
            if p is target:
                return offset
            offset += p.local_size(tp_size)
        raise AssertionError("unreachable: part() found the part")

    def _check_parts_cover(self, size: int) -> None:
        total = sum(p.size for p in self.parts)
        if total != size:
            raise ValueError(
                f"parts {[(p.name, p.size) for p in self.parts]} sum to {total}, "
                f"but the full tensor has {size} along dim {self.dim}"
            )


def head_range(num_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first head, head count) rank `tp_rank` holds of `num_heads` heads.

    With fewer heads than ranks every rank holds one head, replicated: the kv head its q heads
    attend with, `tp_rank * num_heads // tp_size`. The KV cache of a rank holds the same heads.
    """
    _check_rank(tp_rank, tp_size)
    if num_heads < tp_size:
        return tp_rank * num_heads // tp_size, 1
    return tp_rank * (num_heads // tp_size), num_heads // tp_size


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The [start, end) vocabulary rows that rank `tp_rank` owns (end may equal start)."""
    per = _rows_per_rank(vocab_size, tp_size)
    start = min(tp_rank * per, vocab_size)
    return start, min(start + per, vocab_size)


def shard_tensor(full: torch.Tensor, spec: ShardSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's shard of a full tensor. Pure: `full` is not modified (result may view it)."""
    _check_rank(tp_rank, tp_size)
    dim = spec.dim
    if dim is None:
        return full
    if full.dim() <= dim:
        raise ValueError(f"{spec.kind} spec splits dim {dim}, tensor of shape {tuple(full.shape)}")
    if spec.kind == "vocab":
        return _shard_vocab(full, tp_rank, tp_size)
    if not spec.parts:
        return ShardPart(spec.kind, full.shape[dim]).cut(full, dim, tp_rank, tp_size)
    spec._check_parts_cover(full.shape[dim])
    pieces = full.split([p.size for p in spec.parts], dim=dim)
    return torch.cat(
        [p.cut(x, dim, tp_rank, tp_size) for p, x in zip(spec.parts, pieces, strict=True)],
        dim=dim,
    )


def shard_part(
    part_full: torch.Tensor, spec: ShardSpec, name: str | int, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This rank's piece of one part of a fused parameter, given that part's full tensor."""
    _check_rank(tp_rank, tp_size)
    dim = spec.dim
    if dim is None or not spec.parts:
        raise ValueError(f"a {spec.kind} spec without parts has no part {name!r}")
    return spec.part(name).cut(part_full, dim, tp_rank, tp_size)


@torch.no_grad()
def load_full(
    param: torch.Tensor,
    full: torch.Tensor,
    spec: ShardSpec,
    layout: ParallelLayout,
    part: str | int | None = None,
) -> None:
    """Copy this rank's cut of `full` into `param` (converting dtype and device).

    With `part`, `full` is the full tensor of that one part of a fused parameter (e.g. the
    checkpoint's `k_proj.weight` for the fused qkv weight) and only that slice is written.
    """
    if part is None:
        local = shard_tensor(full, spec, layout.tp_rank, layout.tp_size)
        target = param.data
    else:
        local = shard_part(full, spec, part, layout.tp_rank, layout.tp_size)
        assert spec.dim is not None  # shard_part raised otherwise
        offset = spec.part_offset(part, layout.tp_size)
        target = param.data.narrow(spec.dim, offset, local.shape[spec.dim])
    if target.shape != local.shape:
        what = "parameter" if part is None else f"part {part!r} of the parameter"
        raise ValueError(
            f"{what} holds shape {tuple(target.shape)} on tp_rank {layout.tp_rank}/"
            f"{layout.tp_size}, but the {spec.kind} cut of the given tensor "
            f"{tuple(full.shape)} is {tuple(local.shape)}"
        )
    copy_rows_(target, local)


# Rows per copy into a transposed target: a tile that stays in cache on both sides.
_TILE_ROWS = 32


def is_input_major(t: torch.Tensor) -> bool:
    """A 2-D [out, in] tensor (or a slice of rows of one) laid out as the transposed view of
    [in, out] storage: the engine's input-major CPU matmul weights."""
    return t.dim() == 2 and t.stride(0) == 1 and t.stride(1) != 1


def copy_rows_(target: torch.Tensor, source: torch.Tensor) -> None:
    """target.copy_(source), in tiles of rows when `target` is stored transposed (the engine's
    input-major CPU weights): a transposing copy in tiles stays in cache, one whole-tensor
    copy_ does not."""
    if not is_input_major(target):
        target.copy_(source)
        return
    for start in range(0, target.shape[0], _TILE_ROWS):
        target[start : start + _TILE_ROWS].copy_(source[start : start + _TILE_ROWS])


def _rows_per_rank(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size)


def _shard_vocab(full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    per = _rows_per_rank(full.shape[0], tp_size)
    start, end = vocab_range(full.shape[0], tp_rank, tp_size)
    if end - start == per:
        return full[start:end]
    local = full.new_zeros((per, *full.shape[1:]))
    local[: end - start] = full[start:end]
    return local


def _check_rank(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
