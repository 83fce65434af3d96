"""Process-group set-up for the job: torchrun's environment, or a single plain process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class World:
    """This process in the job: global rank and size, rank on its node, device, and the
    ranks per node (torchrun's LOCAL_WORLD_SIZE; None: one node holds the whole world)."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    local_world_size: int | None = None

    @property
    def node_size(self) -> int:
        """Ranks per node: a rollout TP group never has more (docs/distributed.md)."""
        return self.local_world_size or self.size

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world(timeout_s: float = 600.0) -> World:
    """Join torchrun's group or run as one process. On CUDA the group is
    `cpu:gloo,cuda:nccl`: device tensors go over NCCL, objects and host tensors (object
    collectives, control traffic) over gloo; on CPU it is gloo.

    Every collective is bounded by `timeout_s`, so a rank that died makes the others fail
    with a timeout instead of hanging.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if size > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if cuda else "gloo",
            timeout=timeout,
            store=_attempt_store(timeout),
            rank=rank,
            world_size=size,
        )
    return World(rank, size, local_rank, device, local_size)


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun on one node, the agent's store with this restart attempt's own key
    prefix: torch 2.13 keeps the store across `--max-restarts` restarts, and workers of a new
    attempt otherwise read the dead attempt's keys (a failed or hung rendezvous). Across nodes
    the attempt count differs per node, so there torchrun's own setting is left alone
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 avoids the shared store)."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not shared or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"patrl/attempt_{attempt}/", base)


def close_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_gather_objects(world: World, value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a list of one without a process group)."""
    if not world.distributed:
        return [value]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, value)
    return out


def broadcast_object(world: World, value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()
