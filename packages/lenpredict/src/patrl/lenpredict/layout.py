"""A rollout layout: `dp` data-parallel replicas, each a tensor-parallel group of `tp` ranks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class RankLayout(Protocol):
    """A rank's place in a dp x tp grid, as far as the grid's shape goes
    (patrl.tpreshard.ParallelLayout)."""

    @property
    def dp_size(self) -> int: ...

    @property
    def tp_size(self) -> int: ...


@dataclass(frozen=True, slots=True, order=True)
class Layout:
    """The shape of a rollout world's grid: `dp` replicas of `tp` ranks (the planner's unit).

    Its rank-level twin is `patrl.tpreshard.ParallelLayout`: one rank's coordinates on the
    same two axes (`dp_size`/`dp_rank`, `tp_size`/`tp_rank`) with their process groups. They
    stay two objects because lenpredict imports neither torch nor another patrl package (the
    planner runs without a GPU stack) and tpreshard imports no other patrl package; the
    relation is: `Layout.of(parallel)` is the grid a rank's layout belongs to, and
    `GroupCache.layout(grid.tp)` is this rank's place in `grid` (a round trip)."""

    dp: int
    tp: int

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ValueError(f"Layout needs dp >= 1 and tp >= 1, got dp={self.dp} tp={self.tp}")

    @classmethod
    def of(cls, parallel: RankLayout) -> Layout:
        """The grid `parallel` (a rank's `ParallelLayout`) is a place in."""
        return cls(dp=parallel.dp_size, tp=parallel.tp_size)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def __str__(self) -> str:
        return f"dp{self.dp}xtp{self.tp}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Inverse of `str(layout)`: 'dp4xtp2'."""
        try:
            dp_part, tp_part = text.split("x")
            return cls(dp=int(dp_part.removeprefix("dp")), tp=int(tp_part.removeprefix("tp")))
        except ValueError as err:
            raise ValueError(f"cannot parse layout {text!r}; expected e.g. 'dp4xtp2'") from err


def usable_tp_sizes(
    candidates: Iterable[int], world_size: int, node_size: int | None = None
) -> tuple[int, ...]:
    """The candidate TP sizes that divide `world_size` and, given `node_size` (ranks per node),
    divide it too; sorted and unique.

    The one place that derives which layouts a world can form: a size that does not divide the
    world cannot cut it into whole TP groups, and one that does not divide a node would put a
    TP group (consecutive ranks) across two nodes, whose per-layer collectives then leave the
    node's fast links."""
    node = node_size or world_size
    return tuple(
        sorted(tp for tp in set(candidates) if tp >= 1 and world_size % tp == 0 and node % tp == 0)
    )


def layouts_for(world_size: int, tp_sizes: list[int]) -> list[Layout]:
    """Every layout of `world_size` ranks with a TP size from `tp_sizes`, smallest TP first."""
    usable = usable_tp_sizes(tp_sizes, world_size)
    bad = [tp for tp in tp_sizes if tp not in usable]
    if bad:
        raise ValueError(f"tp sizes {bad} do not divide world_size={world_size}")
    return [Layout(dp=world_size // tp, tp=tp) for tp in usable]


def nested(a: Layout, b: Layout) -> bool:
    """True when one layout's TP groups are unions of the other's (contiguous ranks).

    Only then can a switch keep every sequence inside its family of ranks, which is what the
    in-place weight narrowing and the KV head redistribution assume."""
    lo, hi = sorted((a.tp, b.tp))
    return a.world_size == b.world_size and hi % lo == 0
