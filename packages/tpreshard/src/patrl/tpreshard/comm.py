"""Every tensor collective patrl issues (the trainer's aside): through the layout's `ShmComm`
when it has one (ranks on one gloo host), else through its process group (NCCL on GPUs, gloo
elsewhere). Tensors must be on the compute device, as NCCL requires; `device_check` proves it
on CPU. Objects go over the group's CPU half (gloo, or the gloo side of `cpu:gloo,cuda:nccl`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from patrl.tpreshard.device_check import check_tensors
from patrl.tpreshard.shm import ShmComm

if TYPE_CHECKING:
    from patrl.tpreshard.layout import ParallelLayout

__all__ = [
    "all_reduce",
    "batch_send_recv",
    "broadcast_obj",
    "gather_objects",
    "irecv",
    "isend",
    "recv",
    "send",
    "tp_all_gather",
    "tp_all_gather_into",
    "tp_all_reduce",
    "tp_broadcast",
]


def tp_all_reduce(layout: ParallelLayout, t: torch.Tensor) -> torch.Tensor:
    """Sum `t` in place over the layout's TP group (a no-op at TP 1); returns `t`."""
    if layout.tp_size == 1:
        return t
    check_tensors("tp_all_reduce", t)
    if layout.tp_comm is not None:
        return layout.tp_comm.all_reduce(t)
    dist.all_reduce(t, group=layout.tp_group)
    return t


def tp_all_gather(layout: ParallelLayout, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The TP group's tensors concatenated along `dim`, in TP-rank order."""
    if layout.tp_size == 1:
        return t
    check_tensors("tp_all_gather", t)
    if layout.tp_comm is not None:
        return layout.tp_comm.all_gather(t, dim=dim)
    parts = [torch.empty_like(t) for _ in range(layout.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=layout.tp_group)
    return torch.cat(parts, dim=dim)


def tp_all_gather_into(layout: ParallelLayout, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The TP group's tensors stacked into `out` ([tp_size, *t.shape], contiguous)."""
    check_tensors("tp_all_gather_into", out, t)
    if layout.tp_comm is not None:
        return layout.tp_comm.all_gather_into(out, t)
    dist.all_gather(list(out.unbind(0)), t.contiguous(), group=layout.tp_group)
    return out


def gather_objects(comm: ShmComm | None, group: Any, obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in group-rank order: through `comm` when there is one,
    else the process group `group`."""
    if comm is not None:
        return comm.all_gather_object(obj)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_obj(comm: ShmComm | None, group: Any, obj: Any, src: int = 0) -> Any:
    """Group rank `src`'s picklable `obj` on every rank: through `comm` when there is one,
    else the process group `group`."""
    if comm is not None:
        return comm.broadcast_object(obj, src=src)
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=src)
    return box[0]


def tp_broadcast(layout: ParallelLayout, t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """TP rank `src`'s `t` into `t` on every TP rank, in place; returns `t`."""
    if layout.tp_size == 1:
        return t
    check_tensors("tp_broadcast", t)
    if layout.tp_comm is not None:
        return layout.tp_comm.broadcast(t, src=src)
    dist.broadcast(t, group=layout.tp_group, group_src=src)
    return t


def all_reduce(group: Any, t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `t` in place by `op` over the process group `group` (None: no peers); returns `t`."""
    if group is None:
        return t
    check_tensors("all_reduce", t)
    dist.all_reduce(t, op=op, group=group)
    return t


def send(group: Any, t: torch.Tensor, dst: int) -> None:
    """Send `t` to group rank `dst` of the process group `group`."""
    check_tensors("send", t)
    dist.send(t, group=group, group_dst=dst)


def recv(group: Any, t: torch.Tensor, src: int) -> torch.Tensor:
    """Receive group rank `src`'s tensor into `t`; returns `t`."""
    check_tensors("recv", t)
    dist.recv(t, group=group, group_src=src)
    return t


def isend(group: Any, t: torch.Tensor, dst: int, tag: int = 0) -> dist.Work | None:
    """Start sending `t` to group rank `dst` of `group`; returns the work to wait on."""
    check_tensors("isend", t)
    return dist.isend(t, group=group, group_dst=dst, tag=tag)


def batch_send_recv(group: Any, ops: Sequence[tuple[bool, torch.Tensor, int, int]]) -> list[Any]:
    """Start `ops`, each (is_send, tensor, group peer, tag), as one batch; returns the works
    to wait on. On NCCL a batch runs on the group's own communicator, where single sends and
    receives would each make a two-rank one (`GroupCache.connect` made the group's)."""
    for is_send, t, _, _ in ops:
        check_tensors("isend" if is_send else "irecv", t)
    if not ops:
        return []
    batch = [
        dist.P2POp(c10d.isend if is_send else c10d.irecv, t, group=group, tag=tag, group_peer=peer)
        for is_send, t, peer, tag in ops
    ]
    return list(dist.batch_isend_irecv(batch))


def irecv(group: Any, t: torch.Tensor, src: int, tag: int = 0) -> dist.Work | None:
    """Start receiving group rank `src`'s tensor into `t`; returns the work to wait on."""
    check_tensors("irecv", t)
    return dist.irecv(t, group=group, group_src=src, tag=tag)
