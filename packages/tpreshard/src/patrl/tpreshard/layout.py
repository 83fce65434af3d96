"""Where this rank sits in the data-parallel x tensor-parallel grid, as plain data.

A layout is passed explicitly to every layer that communicates: a library never reaches for
the default process group, because in RL the trainer's world and the rollout's TP groups differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from patrl.tpreshard.shm import ShmComm

__all__ = ["ParallelLayout", "single_process_layout"]


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """One rank's coordinates: its TP group (shards a model) and its DP group (replicas).

    The grid it is a place in, `dp_size` x `tp_size`, is `patrl.lenpredict.Layout.of(self)`
    (the planner's `Layout`, axes `dp` and `tp`); `GroupCache.layout(tp)` goes back. Not one
    object: tpreshard imports no other patrl package, and lenpredict no torch (process
    groups are torch objects)."""

    tp_size: int
    tp_rank: int
    tp_group: ProcessGroup | None
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: ProcessGroup | None = None
    # The TP group's per-step collectives through shared memory (ranks on one host); None:
    # they go through `tp_group`. See patrl.tpreshard.shm.
    tp_comm: ShmComm | None = None

    def __post_init__(self) -> None:
        _check_axis("tp", self.tp_size, self.tp_rank, self.tp_group)
        _check_axis("dp", self.dp_size, self.dp_rank, self.dp_group)

    @property
    def is_tp_first(self) -> bool:
        """True on the rank that speaks for its TP group (decisions are made once, there)."""
        return self.tp_rank == 0


def single_process_layout() -> ParallelLayout:
    """The trivial layout: no TP, no DP, no process groups."""
    return ParallelLayout(tp_size=1, tp_rank=0, tp_group=None)


def _check_axis(axis: str, size: int, rank: int, group: ProcessGroup | None) -> None:
    if size < 1:
        raise ValueError(f"{axis}_size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"{axis}_rank must be in [0, {axis}_size={size}), got {rank}")
    if size > 1 and group is None:
        raise ValueError(f"{axis}_group is required when {axis}_size={size} > 1, got None")
