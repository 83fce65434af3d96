"""The multi-rank helper itself: results by rank, failures with tracebacks, no hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from patrl_testkit.multirank import RankFailed, run_ranks

pytestmark = pytest.mark.multirank


def _sum_ranks(rank: int, world_size: int, scale: float) -> float:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return float(t.item())


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")
    # Rank 0 waits in a collective its failed peer never joins.
    dist.all_reduce(torch.ones(1))


def _hang_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def _die_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _tensor_of_rank(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((3,), float(rank))


def test_results_come_back_by_rank() -> None:
    assert run_ranks(_sum_ranks, world_size=2, args=(2.0,)) == [2.0, 2.0]
    # Tensors outlive the rank that made them.
    tensors = run_ranks(_tensor_of_rank, world_size=2)
    assert [t.tolist() for t in tensors] == [[0.0] * 3, [1.0] * 3]


def test_exception_carries_failing_rank_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_raise_on_rank_1, world_size=2, timeout_s=60)
    message = str(info.value)
    assert "rank 1 raised" in message
    assert "ValueError: boom from rank one" in message
    assert "_raise_on_rank_1" in message  # the traceback names the frame
    assert time.monotonic() - start < 30  # the waiting peer is not waited on for long


def test_hanging_rank_times_out_instead_of_hanging() -> None:
    # Rank 1 waits in the final barrier for rank 0, which sleeps; the collective timeout is
    # longer than the run's, so the run's timeout is what ends it, for both ranks.
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"ranks \[0, 1\] did not finish within timeout_s=15"):
        run_ranks(_hang_on_rank_0, world_size=2, timeout_s=15, collective_timeout_s=120)
    assert time.monotonic() - start < 60


def test_rank_dying_without_report_is_a_failure() -> None:
    with pytest.raises(RankFailed, match=r"rank 1 raised:\nprocess exited with code 3"):
        run_ranks(_die_on_rank_1, world_size=2, timeout_s=60, collective_timeout_s=5)
