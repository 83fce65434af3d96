"""GroupCache: all groups made once at start-up, layouts afterwards are pure look-ups."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from patrl.tpreshard.groups import GroupCache
from patrl_testkit.multirank import run_ranks


def _layouts(rank: int, world_size: int) -> dict[str, object]:
    cache = GroupCache([1, 2, 4], world_size=world_size, rank=rank)
    created = cache.num_created
    seen = {}
    for tp in (1, 2, 4, 2, 1):
        layout = cache.layout(tp)
        t = torch.tensor([float(rank)])
        if layout.tp_group is not None:
            dist.all_reduce(t, group=layout.tp_group)
        seen[tp] = (layout.tp_rank, layout.dp_rank, layout.dp_size, t.item())
    assert cache.num_created == created  # look-ups create nothing
    return {"created": created, "seen": seen}


@pytest.mark.multirank
def test_group_cache_on_four_ranks() -> None:
    results = run_ranks(_layouts, world_size=4, timeout_s=120)
    # tp=1: one DP group of 4; tp=2: TP {0,1},{2,3} + DP {0,2},{1,3}; tp=4: one TP group of 4
    # (the same rank tuple as tp=1's DP group, so shared).
    assert all(r["created"] == 5 for r in results)
    assert results[3]["seen"][2] == (1, 1, 2, 5.0)  # ranks 2+3
    assert results[0]["seen"][4] == (0, 0, 1, 6.0)
    assert results[1]["seen"][1] == (0, 1, 4, 1.0)


def test_candidates_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match="candidate TP size 3 must divide the world size 4"):
        GroupCache([3], world_size=4, rank=0)


def _stranded(rank: int, world_size: int) -> str:
    from datetime import timedelta

    cache = GroupCache([2], world_size=world_size, rank=rank, timeout=timedelta(seconds=2))
    if rank == 1:
        return "skipped"  # never joins the all-reduce below
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1), group=cache.layout(2).tp_group)
    except RuntimeError:
        return f"failed after {time.perf_counter() - start:.0f}s"
    return "returned"


@pytest.mark.multirank
def test_a_collective_on_a_cached_group_times_out_instead_of_hanging() -> None:
    results = run_ranks(_stranded, world_size=2, timeout_s=120)
    assert results[1] == "skipped"
    assert results[0].startswith("failed after") and float(results[0].split()[-1][:-1]) < 30
