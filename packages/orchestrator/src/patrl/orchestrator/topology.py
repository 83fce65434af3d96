"""The rollout's rank layout as the running ranks report it, written to
`<run_dir>/topology.json` by the first rank: each rank's node (torchrun's GROUP_RANK) and host,
and, per TP size, its TP group and whether that group's collectives go through shared memory.
It lets a user (and the multi-node test) check that no TP group leaves a node.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from patrl.orchestrator.distributed import World, all_gather_objects
from patrl.tpreshard import GroupCache, node_rank_from_env

TOPOLOGY_FILE = "topology.json"


def rank_report(world: World, groups: GroupCache) -> dict[str, Any]:
    """This rank's node, host and, per candidate TP size, its TP group and communicator."""
    tp: dict[str, Any] = {}
    for size in groups.candidates:
        layout = groups.layout(size)
        group = groups.tp_group_ranks(size)[layout.dp_rank]
        tp[str(size)] = {
            "group": list(group),
            "comm": "none" if size == 1 else "shm" if layout.tp_comm else "process_group",
        }
    return {
        "rank": world.rank,
        "node": node_rank_from_env(),
        "host": socket.gethostname(),
        "tp": tp,
    }


def gather_topology(world: World, groups: GroupCache) -> dict[str, Any]:
    """Every rank's `rank_report`, in rank order, and whether the world has a shared-memory
    communicator; every rank must call this."""
    return {
        "world_size": world.size,
        "num_nodes": groups.nodes.num_nodes,
        "node_sizes": groups.nodes.node_sizes(),
        "tp_sizes": list(groups.candidates),
        "world_comm": "shm" if groups.world_comm() is not None else "process_group",
        "ranks": all_gather_objects(world, rank_report(world, groups)),
    }


def straddling_groups(topology: dict[str, Any]) -> list[tuple[int, list[int]]]:
    """(TP size, ranks) of every TP group whose ranks reported different nodes."""
    node = {r["rank"]: r["node"] for r in topology["ranks"]}
    found: list[tuple[int, list[int]]] = []
    for size in topology["tp_sizes"]:
        groups = {tuple(r["tp"][str(size)]["group"]) for r in topology["ranks"]}
        found += [(size, list(g)) for g in sorted(groups) if len({node[m] for m in g}) > 1]
    return found


def record_topology(world: World, groups: GroupCache, run_dir: Path) -> Path | None:
    """Gather the topology (every rank calls this); the first rank writes it to
    `run_dir/topology.json`, prints one line about it and returns the path."""
    topology = gather_topology(world, groups)
    if not world.is_first:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / TOPOLOGY_FILE
    path.write_text(json.dumps(topology, indent=1) + "\n")
    comms = {r["tp"][str(t)]["comm"] for r in topology["ranks"] for t in topology["tp_sizes"]}
    across = straddling_groups(topology)
    print(
        f"topology: {topology['num_nodes']} node(s) of {topology['node_sizes']} ranks, "
        f"rollout TP sizes {topology['tp_sizes']}, TP groups across nodes: {across or 'none'}, "
        f"TP collectives: {sorted(comms - {'none'}) or ['none']}; {path}",
        flush=True,
    )
    return path
