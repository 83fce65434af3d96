"""Node rules: a TP group never leaves a node; shared-memory collectives only inside one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from patrl.tpreshard import GroupCache, NodeMap, ShmComm, node_rank_from_env, tp_group_ranks
from patrl_testkit.multirank import run_ranks


def test_uniform_nodes_number_ranks_as_torchrun_does() -> None:
    nodes = NodeMap.uniform(8, 4)
    assert nodes.node_of == (0, 0, 0, 0, 1, 1, 1, 1)
    assert nodes.num_nodes == 2 and nodes.node_sizes() == [4, 4]
    assert nodes.within_one_node([4, 5, 6, 7]) and not nodes.within_one_node([3, 4])
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 must divide the world size 8"):
        NodeMap.uniform(8, 3)


def test_tp_groups_are_consecutive_ranks() -> None:
    assert tp_group_ranks(4, 2) == [(0, 1), (2, 3)]
    assert tp_group_ranks(4, 1) == [(0,), (1,), (2,), (3,)]
    assert tp_group_ranks(4, 4) == [(0, 1, 2, 3)]


@pytest.mark.parametrize(
    ("world", "per_node", "usable"),
    [
        (8, 8, (1, 2, 4, 8)),  # one node of 8 GPUs: every fold
        (16, 8, (1, 2, 4, 8)),  # two nodes of 8: no fold of 16
        (4, 2, (1, 2)),  # two agents of 2 ranks (the e2e test): no fold of 4
        (2, 1, (1,)),  # two nodes of 1: no TP at all
        (6, 3, (1, 3)),  # 2 does not divide a node of 3: its groups would straddle
    ],
)
def test_usable_tp_sizes_stay_inside_a_node(
    world: int, per_node: int, usable: tuple[int, ...]
) -> None:
    assert NodeMap.uniform(world, per_node).usable_tp_sizes(range(1, world + 1)) == usable


def test_a_fold_larger_than_a_node_is_refused_naming_it() -> None:
    problem = NodeMap.uniform(4, 2).tp_problem(4)
    assert problem is not None
    assert "TP size 4" in problem and "LOCAL_WORLD_SIZE=2" in problem and "2 nodes" in problem
    assert NodeMap.uniform(4, 2).tp_problem(2) is None
    assert "does not divide the world size 4" in (NodeMap.uniform(4, 2).tp_problem(3) or "")


def test_unequal_nodes_are_checked_group_by_group() -> None:
    nodes = NodeMap((0, 0, 1, 1, 1, 1))  # a node of 2, then one of 4
    assert nodes.usable_tp_sizes([1, 2, 3, 6]) == (1, 2)  # (0,1), (2,3), (4,5) are in nodes
    assert "node sizes [2, 4]" in (nodes.tp_problem(3) or "")


def test_the_node_is_torchruns_group_rank() -> None:
    assert node_rank_from_env({}) == 0  # outside torchrun: one node
    assert node_rank_from_env({"GROUP_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) == 3
    with pytest.raises(ValueError, match="GROUP_RANK='x'"):
        node_rank_from_env({"GROUP_RANK": "x"})


def test_group_cache_refuses_a_candidate_across_nodes_before_making_groups() -> None:
    # No process group exists here: the refusal comes before any group would be made.
    with pytest.raises(ValueError, match="TP size 4 would put a TP group across two nodes"):
        GroupCache([1, 2, 4], world_size=4, rank=0, nodes=NodeMap.uniform(4, 2))


def _two_nodes(rank: int, world_size: int) -> dict[str, object]:
    # torchrun's GROUP_RANK for 2 agents of 2 ranks each, on this one host
    os.environ["GROUP_RANK"] = str(rank // 2)
    cache = GroupCache([1, 2], world_size=world_size, rank=rank)
    layout = cache.layout(2)
    t = torch.tensor([float(rank)])
    if layout.tp_comm is not None:
        layout.tp_comm.all_reduce(t)
    dist.barrier()
    return {
        "nodes": cache.nodes.node_of,
        "shm": isinstance(layout.tp_comm, ShmComm),
        "sum": t.item(),
        "world_comm": cache.world_comm() is not None,
    }


@pytest.mark.multirank
def test_shared_memory_stays_inside_each_node() -> None:
    results = run_ranks(_two_nodes, world_size=4, timeout_s=120)
    assert all(r["nodes"] == (0, 0, 1, 1) for r in results)  # gathered, the same everywhere
    assert all(r["shm"] for r in results)  # each node's TP group of 2 over shared memory
    assert [r["sum"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert not any(r["world_comm"] for r in results)  # the world spans two nodes
