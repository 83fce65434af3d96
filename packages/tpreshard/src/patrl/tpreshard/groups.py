"""Every process group a run may use, created once, up front, in the same order on every rank.

A rank that skips a `new_group` call makes a *later* group creation hang (group names come from
a per-process counter; research/feasibility.md §2), so `GroupCache` builds the TP and DP groups
of every candidate layout at start-up and `layout(tp)` only looks them up. TP groups are
consecutive ranks, always inside one node (`patrl.tpreshard.nodes`: a node is a torchrun agent);
DP groups join the ranks with the same TP rank and may span nodes. A gloo TP group also gets a
`ShmComm` (`tp_comm="auto"`), and so does the whole world when it is one node of gloo ranks
(`world_comm()`). On an NCCL world every group is `cpu:gloo,cuda:nccl`: device tensors over
NCCL, objects over gloo; `connect` makes NCCL's communicators (lazy otherwise) at start-up too.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from patrl.tpreshard.comm import all_reduce
from patrl.tpreshard.layout import ParallelLayout
from patrl.tpreshard.nodes import NodeMap, gather_node_map, tp_group_ranks
from patrl.tpreshard.shm import ShmComm, shm_supported

TP_COMM_CHOICES = ("auto", "shm", "process_group")

__all__ = ["GroupCache"]


class GroupCache:
    """The TP and DP groups of every candidate TP size, made by every rank at once. `nodes`
    (default: gathered from each rank's GROUP_RANK) decides which ranks share a node; a
    candidate whose TP groups would leave a node is an error naming it."""

    def __init__(
        self,
        candidate_tp_sizes: Iterable[int],
        *,
        world_size: int | None = None,
        rank: int | None = None,
        nodes: NodeMap | None = None,
        backend: str | None = None,
        timeout: timedelta | None = None,
        tp_comm: str = "auto",
    ) -> None:
        self.world_size = world_size if world_size is not None else dist.get_world_size()
        self.rank = rank if rank is not None else dist.get_rank()
        self.candidates = sorted(set(candidate_tp_sizes))
        if tp_comm not in TP_COMM_CHOICES:
            raise ValueError(f"tp_comm must be one of {TP_COMM_CHOICES}, got {tp_comm!r}")
        for tp in self.candidates:
            if tp < 1 or self.world_size % tp:
                raise ValueError(
                    f"candidate TP size {tp} must divide the world size {self.world_size}; "
                    f"divisors: {[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}"
                )
        self.nodes = nodes if nodes is not None else gather_node_map(self.world_size)
        if self.nodes.world_size != self.world_size:
            raise ValueError(
                f"nodes cover {self.nodes.world_size} ranks, the world has {self.world_size}"
            )
        for tp in self.candidates:
            if (problem := self.nodes.tp_problem(tp)) is not None:
                raise ValueError(f"candidate {problem}")
        self.num_created = 0
        self._backend = _with_cpu_half(backend)
        # Every collective on these groups (reshards, KV moves) fails after `timeout` instead of
        # hanging on a dead peer; None keeps torch's default for new groups.
        self._timeout = timeout
        self._groups: dict[tuple[int, ...], Any] = {}
        for tp in self.candidates:
            for ranks in self._tp_ranks(tp) + self._dp_ranks(tp):
                self._create(ranks)
        # all ranks, for control traffic that spans layouts (often tp=1's DP group already)
        self._create(tuple(range(self.world_size)))
        self._comms = self._create_comms(tp_comm)
        self._world_comm = self._create_world_comm(tp_comm)
        self.connected: list[torch.device] = []

    def connect(self, device: torch.device) -> None:
        """One small all-reduce on `device` over every group this rank is in, in the order
        the groups were made (the same on every rank): an NCCL group makes its communicator,
        and takes device memory for it, at its first collective, so an engine connects before
        it sizes its KV cache and no fold makes one later. Once per device; every rank of
        the world calls it at once."""
        if device in self.connected:
            return
        for ranks, group in self._groups.items():  # dicts keep the creation order
            if self.rank in ranks:
                all_reduce(group, torch.ones(1, device=device))
        self.connected.append(device)

    def _create_comms(self, mode: str) -> dict[tuple[int, ...], ShmComm]:
        """A ShmComm for this rank's TP group of every candidate size that can have one (gloo,
        x86-64; inside one node, as every TP group is)."""
        comms: dict[tuple[int, ...], ShmComm] = {}
        if mode == "process_group":
            return comms
        timeout_s = self._timeout.total_seconds() if self._timeout is not None else 300.0
        for tp in self.candidates:
            ranks = self._tp_ranks(tp)[self.rank // tp]
            if tp == 1:
                continue
            group = self._groups[ranks]
            in_node = self.nodes.within_one_node(ranks)
            eligible = shm_supported() and in_node and str(dist.get_backend(group)) == "gloo"
            if mode == "shm" and not eligible:
                raise ValueError(
                    f"tp_comm='shm' needs gloo TP groups inside one node on x86-64; TP size {tp} "
                    f"(nodes of {self.nodes.node_sizes()} ranks, backend "
                    f"{dist.get_backend(group)}) has none; use tp_comm='auto' or 'process_group'"
                )
            if eligible:
                comms[ranks] = ShmComm(group, timeout_s=timeout_s, name=f"tp{tp}")
        return comms

    def _create_world_comm(self, mode: str) -> ShmComm | None:
        """A ShmComm over every rank when the whole world is one node of gloo ranks, for the adaptive
        controller's control traffic (a summary all-gather and a decision broadcast); the TP
        group of the world's size, when a candidate, is the world and its comm serves."""
        world = tuple(range(self.world_size))
        if world in self._comms:
            return self._comms[world]
        group = self._groups.get(world)
        if mode == "process_group" or group is None or self.nodes.num_nodes > 1:
            return None
        if not shm_supported() or str(dist.get_backend(group)) != "gloo":
            return None
        # a rank whose replica ran dry waits here while the others decode: as long as the
        # world group itself would wait (torch's default when no timeout was given)
        timeout = self._timeout or dist.default_pg_timeout
        # pickled per-check summaries are small: 1 MB slots, larger ones go in rounds
        return ShmComm(group, slot_bytes=1 << 20, timeout_s=timeout.total_seconds(), name="world")

    def _tp_ranks(self, tp: int) -> list[tuple[int, ...]]:
        return tp_group_ranks(self.world_size, tp)

    def _dp_ranks(self, tp: int) -> list[tuple[int, ...]]:
        return [tuple(range(r, self.world_size, tp)) for r in range(tp)]

    def _create(self, ranks: tuple[int, ...]) -> None:
        if len(ranks) == 1 or ranks in self._groups:
            return  # a group of one needs no communicator; a repeated one is shared
        # Every rank calls new_group for every group, members or not (see the module docstring).
        group = dist.new_group(list(ranks), backend=self._backend, timeout=self._timeout)
        self.num_created += 1
        self._groups[ranks] = group

    def layout(self, tp: int) -> ParallelLayout:
        """This rank's layout with TP size `tp`; creates nothing."""
        if tp not in self.candidates:
            raise ValueError(
                f"TP size {tp} is not a candidate of this GroupCache: {self.candidates}"
            )
        tp_ranks = self._tp_ranks(tp)[self.rank // tp]
        dp_ranks = self._dp_ranks(tp)[self.rank % tp]
        return ParallelLayout(
            tp_size=tp,
            tp_rank=self.rank % tp,
            tp_group=self._groups.get(tp_ranks),
            dp_size=self.world_size // tp,
            dp_rank=self.rank // tp,
            dp_group=self._groups.get(dp_ranks),
            tp_comm=self._comms.get(tp_ranks),
        )

    def world_group(self) -> Any:
        """The group of every rank (None in a world of one)."""
        return self._groups.get(tuple(range(self.world_size)))

    def world_comm(self) -> ShmComm | None:
        """Shared-memory collectives over every rank (None unless the world is one node of gloo
        ranks and tp_comm allows it)."""
        return self._world_comm

    def tp_group_ranks(self, tp: int) -> list[tuple[int, ...]]:
        """The global ranks of every TP group at size `tp`, by DP rank."""
        return self._tp_ranks(tp)


def _with_cpu_half(backend: str | None) -> str | None:
    """`backend` (None: the world's) with a gloo half beside NCCL, so object collectives
    (pickled on the host) work on every group; other backends as given."""
    if backend is None and dist.is_initialized():
        backend = str(dist.get_backend())
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
