"""What an adaptive engine is built from: the usable TP sizes, the groups, the planner."""

from __future__ import annotations

import torch.distributed as dist

from patrl.lenpredict import (
    LatencyModel,
    LengthPredictor,
    PlannerConfig,
    Profile,
    ReconfigPlanner,
)
from patrl.rollout.adaptive.controller import TPController
from patrl.rollout.adaptive.protocols import Lengths, Planner
from patrl.rollout.config import EngineConfig
from patrl.rollout.torchrun import join_torchrun_world, launched_world_size
from patrl.rollout.tp_policy import AdaptiveTP
from patrl.tpreshard import GroupCache, ParallelLayout, gather_node_map


def make_planner(policy: AdaptiveTP, world_size: int, max_num_seqs: int) -> Planner:
    """The lenpredict planner, on the latency model fitted from `policy.profile`."""
    if policy.profile is None:
        raise ValueError(
            "tp_policy adaptive needs tp_policy.profile: a latency profile JSON of this machine "
            "and model (write one with `torchrun --nproc_per_node N -m patrl.rollout.profile "
            "--model DIR --out PROFILE.json`), or pass a planner to AdaptiveEngine(planner=...)"
        )
    profile = Profile.load(policy.profile)
    config = PlannerConfig(
        candidate_tp=tuple(sorted(policy.candidates)),
        margin=policy.margin,
        max_num_seqs=max_num_seqs,
    )
    return ReconfigPlanner(LatencyModel.fit(profile), world_size, config)


def open_controller(
    config: EngineConfig,
    layout: ParallelLayout | None,
    groups: GroupCache | None,
    planner: Planner | None,
    lengths: Lengths | None,
) -> tuple[ParallelLayout | None, GroupCache | None, TPController | None]:
    """(starting layout, groups, controller) of an adaptive engine; every rank of the world
    calls it at once (the groups are made here when not given, over torchrun's world, which
    is joined here when the process was launched as one of several ranks and no process group
    exists yet). One process with nothing to adapt gets no controller: the engine runs as
    static tp=1. Candidates whose TP groups would leave a node are dropped
    (patrl.tpreshard.nodes)."""
    policy = config.tp_policy
    assert isinstance(policy, AdaptiveTP)
    timeout = None  # a world made here bounds its groups' collectives as it does its own
    if groups is None and launched_world_size() > 1:
        timeout = join_torchrun_world(config, "tp_policy adaptive")  # see rollout.torchrun
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if groups is not None:
        world_size = groups.world_size
    nodes = groups.nodes if groups is not None else gather_node_map(world_size)
    candidates = nodes.usable_tp_sizes(policy.candidates)
    if len(candidates) < 2:
        if world_size > 1 or (layout is not None and layout.tp_size > 1):
            raise ValueError(
                f"tp_policy adaptive: candidates {policy.candidates} leave fewer than two "
                f"TP sizes that divide the world size {world_size} with every TP group inside "
                f"one node (nodes of {nodes.node_sizes()} ranks)"
            )
        return layout, groups, None
    policy = policy.model_copy(update={"candidates": candidates})
    if groups is None:
        groups = GroupCache(candidates, tp_comm=config.tp_comm, timeout=timeout)
    missing = [tp for tp in candidates if tp not in groups.candidates]
    if missing:
        raise ValueError(
            f"tp_policy adaptive: candidate TP sizes {missing} are not in the GroupCache's "
            f"{groups.candidates}"
        )
    start = groups.layout(policy.start_tp)
    if layout is not None and layout != start:
        raise ValueError(
            f"tp_policy adaptive starts at tp={policy.start_tp} (the smallest candidate), "
            f"but the engine was given a layout with tp_size={layout.tp_size}: pass "
            "groups.layout(min(candidates)) or no layout"
        )
    controller = TPController(
        policy,
        planner or make_planner(policy, world_size, config.max_num_seqs),
        lengths or LengthPredictor(),
        groups.world_group(),
        groups.world_comm(),
        config.block_size if config.enable_prefix_caching else 0,
    )
    return start, groups, controller
