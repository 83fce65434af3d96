"""`lenpredict.Layout` (a world's dp x tp grid) and `tpreshard.ParallelLayout` (a rank's place
in one) name the same axes and convert both ways: `Layout.of(parallel)` is the grid,
`GroupCache.layout(grid.tp)` the rank's place in it, for every grid a world can form."""

from __future__ import annotations

from typing import Any

import pytest

from patrl.lenpredict import Layout, layouts_for
from patrl.tpreshard import GroupCache, ParallelLayout, single_process_layout
from patrl_testkit.multirank import run_ranks


def test_a_ranks_layout_is_a_place_in_its_grid() -> None:
    assert Layout.of(single_process_layout()) == Layout(dp=1, tp=1)
    group: Any = object()  # a stand-in: only presence is checked for sizes > 1
    parallel = ParallelLayout(
        tp_size=2,
        tp_rank=1,
        tp_group=group,
        dp_size=3,
        dp_rank=2,
        dp_group=group,
    )
    assert Layout.of(parallel) == Layout(dp=3, tp=2)
    assert Layout.of(parallel).world_size == parallel.dp_size * parallel.tp_size


def _round_trip(rank: int, world_size: int) -> list[Any]:
    groups = GroupCache([1, 2, 4], world_size=world_size, rank=rank)
    seen = []
    for grid in layouts_for(world_size, [1, 2, 4]):
        parallel = groups.layout(grid.tp)
        assert Layout.of(parallel) == grid
        assert groups.layout(Layout.of(parallel).tp) == parallel
        seen.append((str(grid), parallel.dp_rank, parallel.tp_rank))
    return seen


@pytest.mark.multirank
def test_every_grid_of_a_world_round_trips() -> None:
    results = run_ranks(_round_trip, world_size=4, timeout_s=120)
    # each rank sits at (rank // tp, rank % tp) of every grid
    for rank, seen in enumerate(results):
        assert seen == [(f"dp{4 // tp}xtp{tp}", rank // tp, rank % tp) for tp in (1, 2, 4)]
