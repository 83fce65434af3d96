"""Assigning prompt groups to data-parallel rollout replicas.

Pure functions: the orchestrator calls them with predicted lengths, the simulator with the
same, so both balance the same way. A prompt's n samples always go to one replica, where
their prompt KV is prefilled once and shared.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Literal

import numpy as np

AssignmentPolicy = Literal["round_robin", "lpt"]


def round_robin(num_items: int, num_replicas: int) -> list[int]:
    """Item i goes to replica i mod num_replicas."""
    _check(num_replicas)
    return [i % num_replicas for i in range(num_items)]


def longest_processing_time(work: Sequence[float], num_replicas: int) -> list[int]:
    """Longest-processing-time first: the largest remaining item goes to the replica with the
    least work so far (ties to the lowest index, so the result is deterministic)."""
    _check(num_replicas)
    loads = [(0.0, r) for r in range(num_replicas)]
    replica_of = [0] * len(work)
    for i in np.argsort(-np.asarray(work, dtype=float), kind="stable").tolist():
        load, r = heapq.heappop(loads)
        replica_of[i] = r
        heapq.heappush(loads, (load + float(work[i]), r))
    return replica_of


def split_replicas(replica: np.ndarray, work: np.ndarray, split: int) -> np.ndarray:
    """Child (0 .. split-1) of each item within its replica: per replica, items by most work
    first (ties in index order) dealt in snake order 0, 1, .., split-1, split-1, .., 0.

    The one split of replicas into smaller ones: the planner prices it, so a reconfigure must
    run it. Dealing keeps the children's batch sizes within one of each other (decode steps
    cost by batch size) while spreading the longest items."""
    replica, work = np.asarray(replica), np.asarray(work, dtype=float)
    order = np.argsort(replica * (work.max(initial=0.0) + 1.0) - work, kind="stable")
    sorted_replica = replica[order]
    starts = np.flatnonzero(np.r_[True, sorted_replica[1:] != sorted_replica[:-1]])
    rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    lap = rank % (2 * split)
    child = np.empty(len(order), dtype=int)
    child[order] = np.where(lap < split, lap, 2 * split - 1 - lap)
    return child


def assign_prompts(
    predicted_lengths: Sequence[float],
    samples_per_prompt: Sequence[int],
    num_replicas: int,
    policy: AssignmentPolicy = "lpt",
) -> list[int]:
    """Replica of each prompt group. With "lpt" a group's work is its predicted length times
    its number of samples (the decode tokens it will put on its replica)."""
    if len(predicted_lengths) != len(samples_per_prompt):
        raise ValueError(
            f"{len(predicted_lengths)} predicted lengths for {len(samples_per_prompt)} prompts"
        )
    if policy == "round_robin":
        return round_robin(len(predicted_lengths), num_replicas)
    if policy == "lpt":
        work = [p * n for p, n in zip(predicted_lengths, samples_per_prompt, strict=True)]
        return longest_processing_time(work, num_replicas)
    raise ValueError(f"unknown assignment policy {policy!r}; accepted: 'round_robin', 'lpt'")


def _check(num_replicas: int) -> None:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
