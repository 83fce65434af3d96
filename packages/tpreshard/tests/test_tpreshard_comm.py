"""ShmComm: the shared-memory TP collectives against gloo's (their slow reference twin)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from patrl.tpreshard import CollectiveTimeout, GroupCache, ShmComm, shm_supported
from patrl.tpreshard.comm import tp_all_gather, tp_all_reduce, tp_broadcast
from patrl_testkit.clock import FakeClock
from patrl_testkit.multirank import run_ranks

pytestmark = pytest.mark.skipif(not shm_supported(), reason="ShmComm is x86-64 POSIX only")


def _tensors(seed: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return {
        "vector": torch.randn(7, generator=g),
        "matrix": torch.randn(5, 33, generator=g),
        "strided": torch.randn(16, 12, generator=g).t(),  # not contiguous
        "chunked": torch.randn(3, 1000, generator=g),  # > slot_bytes below: several rounds
        "bf16": torch.randn(4, 9, generator=g).to(torch.bfloat16),
        "int64": torch.randint(-50, 50, (11,), generator=g),
        "empty": torch.empty(0, 4),
    }


def _gloo_reference(layout, name: str, t: torch.Tensor, op: str) -> torch.Tensor:
    group = layout.tp_group
    if op == "all_reduce":
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out
    if op == "into":  # stacked on a new leading dim = concatenated on dim 0
        op = "all_gather0"
    if op == "broadcast":
        out = t.clone()
        dist.broadcast(out, group=group, group_src=layout.tp_size - 1)
        return out
    parts = [torch.empty_like(t) for _ in range(layout.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0 if op == "all_gather0" else -1)


def _against_gloo(rank: int, world_size: int) -> dict[str, object]:
    cache = GroupCache([1, 2, world_size], world_size=world_size, rank=rank)
    out: dict[str, object] = {"mismatch": [], "bits": {}}
    for tp in sorted({2, world_size}):
        layout = cache.layout(tp)
        assert isinstance(layout.tp_comm, ShmComm)
        # a second communicator on the same group with tiny slots: every op goes in chunks
        small = ShmComm(layout.tp_group, slot_bytes=1024, name=f"small{tp}")
        for comm_name, comm in (("slots", layout.tp_comm), ("small", small)):
            for name, t in _tensors(tp, rank).items():
                for op in ("all_reduce", "broadcast", "all_gather0", "all_gather-1", "into"):
                    want = _gloo_reference(layout, name, t, op)
                    if op == "all_reduce":
                        got = comm.all_reduce(t.clone())
                    elif op == "broadcast":
                        got = comm.broadcast(t.clone(), src=tp - 1)
                    elif op == "into":
                        out_ = torch.empty(tp, *t.shape, dtype=t.dtype)
                        got = comm.all_gather_into(out_, t).view(-1, *t.shape[1:])
                    else:
                        got = comm.all_gather(t, dim=0 if op == "all_gather0" else -1)
                    key = f"tp{tp}/{comm_name}/{name}/{op}"
                    exact = tp == 2 or op != "all_reduce" or not t.is_floating_point()
                    close = (
                        torch.equal(got, want)
                        if exact
                        # 4 ranks: gloo adds in another order; bf16 rounds each partial sum
                        # (|partial| ~ 2) to 8 bits
                        else torch.allclose(
                            got.float(),
                            want.float(),
                            rtol=1e-5,
                            atol=5e-2 if t.dtype == torch.bfloat16 else 1e-5,
                        )
                    )
                    if got.shape != want.shape or got.dtype != want.dtype or not close:
                        out["mismatch"].append(key)  # type: ignore[union-attr]
                    out["bits"][key] = got.contiguous().view(-1).view(torch.uint8).tolist()  # type: ignore[index]
        # the layer-facing helpers take the same path
        t = torch.full((3,), float(rank))
        assert tp_all_reduce(layout, t) is t
        out[f"helpers{tp}"] = (
            t.tolist(),
            tp_all_gather(layout, torch.tensor([float(rank)])).tolist(),
            tp_broadcast(layout, torch.tensor([float(rank)]), src=1).tolist(),
        )
        out[f"rounds{tp}"] = (layout.tp_comm.rounds, small.rounds)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_shm_collectives_equal_gloo_and_agree_bit_for_bit(world_size: int) -> None:
    results = run_ranks(_against_gloo, world_size=world_size, timeout_s=180)
    for rank, r in enumerate(results):
        assert r["mismatch"] == [], f"rank {rank}: {r['mismatch']}"
        # 7 tensors x 5 ops + 3 helper calls, one round each; the small slots take several
        # rounds for the "chunked" tensor (12,000 bytes in 1,024-byte slots)
        assert r[f"rounds{world_size}"][0] == 38
        assert r[f"rounds{world_size}"][1] >= 35 + 5 * 11
    for tp in sorted({2, world_size}):
        members = range(tp)  # ranks 0..tp-1 form one TP group at every size
        for key in results[0]["bits"]:
            if key.startswith(f"tp{tp}/"):
                assert all(results[m]["bits"][key] == results[0]["bits"][key] for m in members)
        sums, gathered, broadcast = results[0][f"helpers{tp}"]
        assert sums == [float(sum(range(tp)))] * 3
        assert gathered == [float(r) for r in range(tp)]
        assert broadcast == [1.0]


def _modes(rank: int, world_size: int) -> tuple[bool, bool]:
    auto = GroupCache([1, 2], world_size=world_size, rank=rank)
    plain = GroupCache([1, 2], world_size=world_size, rank=rank, tp_comm="process_group")
    assert auto.layout(1).tp_comm is None  # TP 1 makes no TP collectives
    leftovers = list(Path("/dev/shm").glob(f"patrl-*-{os.getpid()}-*"))  # rank 0 names them
    return auto.layout(2).tp_comm is not None, plain.layout(2).tp_comm is None and not leftovers


@pytest.mark.multirank
def test_group_cache_gives_tp_groups_a_shm_comm_and_leaves_no_file_behind() -> None:
    assert run_ranks(_modes, world_size=2, timeout_s=120) == [(True, True), (True, True)]


def test_bad_tp_comm_mode_is_refused_before_any_group_is_made() -> None:
    with pytest.raises(ValueError, match=r"tp_comm must be one of .*'nccl'"):
        GroupCache([1], world_size=1, rank=0, tp_comm="nccl")


_UNREAPED: list[subprocess.Popen[bytes]] = []


def _stranded(rank: int, world_size: int, kill_pid: str) -> str:
    cache = GroupCache([2], world_size=world_size, rank=rank, timeout=timedelta(seconds=2))
    tp_comm = cache.layout(2).tp_comm
    assert tp_comm is not None and tp_comm.timeout_s == 2.0  # the cache hands its timeout on
    pid = None
    if rank == 1 and kill_pid:  # pretend this rank's process died: it names a finished one
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        if kill_pid == "reaped":
            dead.wait()
        else:  # exited and never reaped (its launcher died): a zombie answers kill(pid, 0)
            stat = Path(f"/proc/{dead.pid}/stat")
            while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                time.sleep(0.01)
            _UNREAPED.append(dead)  # Popen.__del__ would reap it
        pid = dead.pid
    # The wait runs on a fake clock that moves 1 ms a read (its spin phase reads without
    # sleeping): the times below are the clock's, whatever the machine's speed.
    clock = FakeClock(tick=1e-3)
    world = dist.group.WORLD
    comm = ShmComm(world, timeout_s=2.0, name="stranded", pid=pid, clock=clock, sleep=clock.sleep)
    if rank == 1:
        dist.barrier()
        return "skipped"  # never joins the all-reduce below (its final barrier is gloo's)
    dist.barrier()
    start = clock()
    try:
        comm.all_reduce(torch.ones(4))
    except CollectiveTimeout as e:
        return f"{clock() - start:.3f} {e}"
    return "returned"


@pytest.mark.multirank
@pytest.mark.parametrize("kill_pid", ["", "reaped", "zombie"])
def test_a_missing_peer_fails_the_wait_naming_it(kill_pid: str) -> None:
    results = run_ranks(_stranded, world_size=2, args=(kill_pid,), timeout_s=120)
    assert results[1] == "skipped"
    waited, message = results[0].split(" ", 1)
    assert "global rank 1" in message and "round 1" in message
    if kill_pid:  # found at the first liveness check, 0.1 s into the wait
        assert "process gone" in message and 0.1 <= float(waited) < 0.2
    else:  # at the first liveness check past timeout_s
        assert "timeout_s=2.0" in message and 2.0 < float(waited) < 2.2


def _slow_peer(rank: int, world_size: int) -> float:
    """A peer that arrives late (after the spin phase) is still met: the back-off sleeps
    instead of giving up, and the sum is right."""
    comm = GroupCache([2], world_size=world_size, rank=rank).layout(2).tp_comm
    assert comm is not None
    if rank == 1:
        time.sleep(0.3)
    return comm.all_reduce(torch.tensor([rank + 1.0])).item()


@pytest.mark.multirank
def test_a_late_peer_is_waited_for() -> None:
    assert run_ranks(_slow_peer, world_size=2, timeout_s=120) == [3.0, 3.0]


def _bad_out(rank: int, world_size: int) -> str:
    comm = GroupCache([2], world_size=world_size, rank=rank).layout(2).tp_comm
    assert comm is not None
    try:
        comm.all_gather_into(torch.empty(3, 4), torch.ones(4))
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.multirank
def test_all_gather_into_names_the_shape_it_needs() -> None:
    results = run_ranks(_bad_out, world_size=2, timeout_s=120)
    assert all("out of shape (2, 4)" in r and "got (3, 4)" in r for r in results)


def test_shm_comm_refuses_misaligned_slots() -> None:
    with pytest.raises(ValueError, match="slot_bytes must be a positive multiple of 64, got 100"):
        ShmComm(None, slot_bytes=100)


def _objects(rank: int, world_size: int) -> dict[str, object]:
    cache = GroupCache([1, 2], world_size=world_size, rank=rank)
    world = cache.world_comm()
    assert world is not None and world.global_ranks == list(range(world_size))
    # a world of 2 is the TP group of 2: its comm serves; a larger world gets its own
    assert (world is cache.layout(2).tp_comm) == (world_size == 2)
    small = ShmComm(cache.world_group(), slot_bytes=1024, name="small-world")
    # per rank a different size: rank 1's pickle spans several 1 KB slots, the others' fit
    mine = {"rank": rank, "rows": [("req", i, 3.5) for i in range(200 if rank == 1 else rank)]}
    out: dict[str, object] = {}
    for name, comm in (("world", world), ("small", small)):
        want: list[object] = [None] * world_size
        dist.all_gather_object(want, mine, group=cache.world_group())
        out[f"{name}/gather"] = comm.all_gather_object(mine) == want
        for src in range(world_size):
            box = [mine]
            dist.broadcast_object_list(box, group=cache.world_group(), group_src=src)
            out[f"{name}/bcast{src}"] = comm.broadcast_object(mine, src=src) == box[0]
        out[f"{name}/none"] = comm.all_gather_object(None) == [None] * world_size
    plain = GroupCache([1, 2], world_size=world_size, rank=rank, tp_comm="process_group")
    out["plain_has_none"] = plain.world_comm() is None
    # rows: refused before any round (so no rank is left waiting), else gathered block-wise
    for bad, message in (
        (torch.zeros(3, 300), "exceeds slot_bytes"),
        (torch.zeros(4, 6).t(), "2-D"),
    ):
        with pytest.raises(ValueError, match=message):
            next(small.all_gather_rows(bad))
    mine_rows = torch.arange(70, dtype=torch.float32).view(10, 7) + 100 * rank
    blocks = list(small.all_gather_rows(mine_rows))  # 36 rows of 28 bytes a 1 KB slot: 1 round
    out["rows_in_one_block"] = [(lo, hi) for lo, hi, _ in blocks] == [(0, 10)]
    tiny = ShmComm(cache.world_group(), slot_bytes=64, name="tiny-world")  # 2 rows a round
    got = [torch.empty(10, 7) for _ in range(world_size)]
    for lo, hi, parts in tiny.all_gather_rows(mine_rows):
        for r, part in enumerate(parts):
            got[r][lo:hi] = part
    want = [torch.arange(70, dtype=torch.float32).view(10, 7) + 100 * r for r in range(world_size)]
    out["rows_in_blocks"] = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_object_collectives_equal_gloo_and_the_world_gets_a_comm(world_size: int) -> None:
    for rank, r in enumerate(run_ranks(_objects, world_size=world_size, timeout_s=180)):
        assert all(r.values()), f"rank {rank}: {r}"
        assert len(r) == 2 * (2 + world_size) + 3
