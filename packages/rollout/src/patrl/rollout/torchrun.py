"""An engine launched under torchrun with no process group yet: it joins the world itself.

A library user runs `torchrun --nproc_per_node 2 script.py` and builds
`Engine(EngineConfig(..., tp_policy=StaticTP(tp=2)))` on every rank, as vLLM's `LLM` does
under its external launcher. The engine then initialises the default process group from
torchrun's environment (gloo on CPU; `cpu:gloo,cuda:nccl` on CUDA, device tensors over NCCL
and objects over gloo, as the orchestrator's job does) and builds its groups from it through
`GroupCache`; the library never runs a collective on the default group itself. A group the
caller made first is used as it is.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from patrl.rollout.config import EngineConfig
from patrl.rollout.tp_policy import AdaptiveTP
from patrl.tpreshard import GroupCache, ParallelLayout

# every collective of a world the engine joins fails after this instead of hanging
TIMEOUT = timedelta(minutes=10)

__all__ = [
    "TIMEOUT",
    "join_torchrun_world",
    "launched_world_size",
    "static_layout",
    "torchrun_groups",
]


def launched_world_size() -> int:
    """The world size torchrun (or any env:// launcher) gave this process; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def join_torchrun_world(config: EngineConfig, need: str) -> timedelta | None:
    """Initialise the default process group from torchrun's environment unless one exists;
    returns the timeout of a world made here (None: the caller's world, left as it is).
    `need` says what wants the ranks (for the error without a launcher). On CUDA with no
    device index given, this rank's device is LOCAL_RANK's, as torchrun intends."""
    if dist.is_initialized():
        return None
    size = launched_world_size()
    if size < 2 or "MASTER_ADDR" not in os.environ:
        raise ValueError(
            f"{need} needs several ranks, and this process was not launched as one of them "
            f"(WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}, MASTER_ADDR "
            f"{'set' if 'MASTER_ADDR' in os.environ else 'unset'}): run it under "
            "`torchrun --nproc_per_node N`, or pass the engine a layout and GroupCache"
        )
    device = config.torch_device()
    if device.type == "cuda" and device.index is None:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=TIMEOUT)
    return TIMEOUT


def torchrun_groups(tp_sizes: Sequence[int], config: EngineConfig, need: str) -> GroupCache:
    """The GroupCache of `tp_sizes` over the world, joined first if need be (every rank of
    the world calls this at once, as it builds its engine)."""
    timeout = join_torchrun_world(config, need)
    return GroupCache(tp_sizes, tp_comm=config.tp_comm, timeout=timeout)


def static_layout(
    config: EngineConfig, layout: ParallelLayout | None, groups: GroupCache | None
) -> tuple[ParallelLayout | None, GroupCache | None]:
    """The (layout, groups) an `Engine` under a static `config.tp_policy` runs at: as given,
    or, for `StaticTP(tp=N)` with N > 1 and no layout, this rank's TP group of N from
    `groups` (made over torchrun's world when not given). Raises for an adaptive policy and
    for a layout of another TP size than the policy's."""
    policy = config.tp_policy
    if isinstance(policy, AdaptiveTP):
        raise ValueError(
            "Engine runs one layout; for tp_policy adaptive use "
            "patrl.rollout.make_engine(config, ...) or AdaptiveEngine(config, ...)"
        )
    if layout is None and policy.tp is not None and policy.tp > 1:
        if groups is None:
            groups = torchrun_groups([policy.tp], config, f"StaticTP(tp={policy.tp})")
        layout = groups.layout(policy.tp)
    if policy.tp is not None and (layout.tp_size if layout else 1) != policy.tp:
        raise ValueError(
            f"tp_policy static tp={policy.tp} but the engine's layout has "
            f"tp_size={layout.tp_size if layout else 1}"
        )
    return layout, groups
