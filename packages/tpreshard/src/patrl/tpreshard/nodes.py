"""Which node every rank runs on, and which TP sizes keep each of their groups inside one.

A node is one torchrun agent (its GROUP_RANK, LOCAL_WORLD_SIZE ranks), not a hostname: two
agents on one host are two nodes, as two machines would be. A TP group (consecutive ranks)
must lie inside one node, because its per-layer collectives need the node's own links (NVLink,
shared memory); so TP sizes larger than a node are never formed. See docs/distributed.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from patrl.tpreshard.comm import gather_objects

__all__ = ["NodeMap", "gather_node_map", "node_rank_from_env", "tp_group_ranks"]


def tp_group_ranks(world_size: int, tp: int) -> list[tuple[int, ...]]:
    """The global ranks of every TP group of size `tp` (consecutive ranks), by DP rank."""
    return [tuple(range(s, s + tp)) for s in range(0, world_size, tp)]


@dataclass(frozen=True, slots=True)
class NodeMap:
    """`node_of[r]`: the node of global rank r; every rank of a job must hold the same map."""

    node_of: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.node_of:
            raise ValueError("NodeMap needs at least one rank, got none")

    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int) -> NodeMap:
        """Nodes of `ranks_per_node` consecutive ranks each, as torchrun numbers them."""
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={ranks_per_node} must divide the world size {world_size}"
            )
        return cls(tuple(r // ranks_per_node for r in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))

    def node_sizes(self) -> list[int]:
        """Ranks per node, by node id."""
        return [self.node_of.count(n) for n in sorted(set(self.node_of))]

    def within_one_node(self, ranks: Iterable[int]) -> bool:
        return len({self.node_of[r] for r in ranks}) == 1

    def tp_problem(self, tp: int) -> str | None:
        """Why TP groups of size `tp` cannot be formed on these nodes, or None when they can."""
        if tp < 1 or self.world_size % tp:
            return f"TP size {tp} does not divide the world size {self.world_size}"
        if all(self.within_one_node(g) for g in tp_group_ranks(self.world_size, tp)):
            return None
        sizes = sorted(set(self.node_sizes()))
        local = f"LOCAL_WORLD_SIZE={sizes[0]}" if len(sizes) == 1 else f"node sizes {sizes}"
        return (
            f"TP size {tp} would put a TP group across two nodes ({self.num_nodes} nodes, "
            f"{local}): a TP group must lie inside one node, so its size must divide the ranks "
            "per node"
        )

    def usable_tp_sizes(self, candidates: Iterable[int]) -> tuple[int, ...]:
        """The candidates whose every TP group lies inside one node, sorted and unique."""
        return tuple(sorted(tp for tp in set(candidates) if self.tp_problem(tp) is None))


def node_rank_from_env(env: Mapping[str, str] | None = None) -> int:
    """This process's node: torchrun's GROUP_RANK (0 outside torchrun: one node)."""
    value = (os.environ if env is None else env).get("GROUP_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"GROUP_RANK={value!r} is not an integer node rank") from None


def gather_node_map(world_size: int, group: object | None = None) -> NodeMap:
    """Every rank's node (`node_rank_from_env`) gathered over `group` (None: the world), in
    rank order; every rank of it must call this. A world of one is one node, with no
    collective. Gathered, not derived, so every rank holds the same map."""
    if world_size == 1:
        return NodeMap((node_rank_from_env(),))
    nodes = NodeMap(tuple(gather_objects(None, group, node_rank_from_env())))
    if nodes.world_size != world_size:
        raise ValueError(
            f"the group has {nodes.world_size} ranks, but world_size={world_size} was given"
        )
    return nodes
