"""The node rule is derived in three places (lenpredict for the planner and the job's
candidates, tpreshard for the groups, preflight for the config check); they must agree."""

from __future__ import annotations

import pytest

from patrl.lenpredict import usable_tp_sizes
from patrl.orchestrator.preflight import layout_problems
from patrl.orchestrator.topology import straddling_groups
from patrl.tpreshard import NodeMap


@pytest.mark.parametrize("world", range(1, 17))
def test_every_derivation_of_the_usable_tp_sizes_agrees(world: int) -> None:
    for per_node in (n for n in range(1, world + 1) if world % n == 0):
        sizes = range(1, world + 1)
        planner = usable_tp_sizes(sizes, world, per_node)
        groups = NodeMap.uniform(world, per_node).usable_tp_sizes(sizes)
        config = tuple(t for t in sizes if not layout_problems(t, world, per_node, None))
        assert planner == groups == config, (world, per_node)
        assert all(per_node % t == 0 for t in planner)


def _report(rank: int, node: int, groups: dict[int, list[int]]) -> dict[str, object]:
    tp = {str(k): {"group": g, "comm": "none" if k == 1 else "shm"} for k, g in groups.items()}
    return {"rank": rank, "node": node, "host": "h", "tp": tp}


def test_straddling_groups_names_a_group_whose_ranks_report_two_nodes() -> None:
    inside = {
        "tp_sizes": [1, 2],
        "ranks": [_report(r, r // 2, {1: [r], 2: [r - r % 2, r - r % 2 + 1]}) for r in range(4)],
    }
    assert straddling_groups(inside) == []
    across = {
        "tp_sizes": [1, 4],
        "ranks": [_report(r, r // 2, {1: [r], 4: [0, 1, 2, 3]}) for r in range(4)],
    }
    assert straddling_groups(across) == [(4, [0, 1, 2, 3])]
