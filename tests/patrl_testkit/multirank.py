"""Run a function on N gloo ranks, the way every multi-rank test in this repo does.

    from patrl_testkit.multirank import run_ranks

    def _body(rank: int, world_size: int, scale: float) -> float:
        t = torch.ones(1) * rank * scale
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_ranks(_body, world_size=2, args=(2.0,)) == [2.0, 2.0]

Guarantees:
- ranks rendezvous on a free port (never a fixed one), gloo backend, CPU;
- the collective timeout of the default group is `collective_timeout_s`, so a rank that waits
  on a peer that will never come fails instead of hanging;
- every rank ends with `barrier()` + `destroy_process_group()` when its body returned;
- an exception in any rank is re-raised in the test as `RankFailed`, carrying that rank's
  traceback; the remaining ranks are killed after a short grace period;
- the whole run is bounded by `timeout_s`: a rank still running then is killed and the test
  fails with the ranks that did not finish.

The body must be a module-level function (it is pickled by name into the rank processes) and
its arguments and return value must be picklable. Test file basenames are unique across the
repo so that the spawned process can import the test module by name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankFailed", "free_port", "run_ranks"]

# How long surviving ranks get to notice a failed peer and exit on their own.
_GRACE_S = 3.0

# Third-party modules every rank imports. Ranks are forked from a fork server that imported them
# once per test session, so a rank starts without re-importing torch and transformers (seconds
# per rank on a small CPU box). Only third-party modules: patrl's own are imported fresh in each
# rank, as under spawn, so nothing read at import time comes from an earlier test.
_PRELOAD = ("numpy", "torch", "torch.distributed", "safetensors.torch", "transformers")


def _context() -> Any:
    """The multiprocessing context ranks start in: a fork server with `_PRELOAD` imported
    (single-threaded, no process group, no CUDA: what a forked rank inherits is only imported
    modules), where the platform has one; else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


class RankFailed(RuntimeError):
    """One or more ranks raised, died or timed out; the message carries their tracebacks."""


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CHECK_DEVICES_ENV = "PATRL_CHECK_COLLECTIVE_DEVICES"


def _run_checked(fn: Callable[..., Any], rank: int, world_size: int, args: Sequence[Any]) -> Any:
    """`fn` on this rank; with PATRL_CHECK_COLLECTIVE_DEVICES=1 inside the collective-device
    check (`patrl.tpreshard.device_check`), so any multi-rank test can prove its collectives
    would take the tensors an NCCL world accepts."""
    if os.environ.get(CHECK_DEVICES_ENV) != "1":
        return fn(rank, world_size, *args)
    from patrl.tpreshard.device_check import check_collective_devices

    with check_collective_devices():
        return fn(rank, world_size, *args)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    collective_timeout_s: float,
    threads: int,
    results: Any,
    environ: dict[str, str],
) -> None:
    # The fork server's environment is the one it started with; a rank gets the test's own at
    # the time of the call, as a spawned process would.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        value = _run_checked(fn, rank, world_size, args)
        dist.barrier()
        # Plain pickle, by value: through the queue torch would share a tensor by a file
        # descriptor that dies with this process before the test reads it.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return values by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                world_size,
                port,
                fn,
                tuple(args),
                collective_timeout_s,
                threads_per_rank,
                results,
                dict(os.environ),
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()

    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    first_failure_at: float | None = None
    try:
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            if first_failure_at is not None and now > first_failure_at + _GRACE_S:
                break
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue.Empty:
                dead = _dead_unreported(procs, values, failures)
                if dead:
                    # A rank that reported and then died at exit has its report in the pipe.
                    _drain(results, values, failures)
                    for r in dead:
                        if r not in values and r not in failures:
                            failures[r] = (
                                f"process exited with code {procs[r].exitcode} "
                                "without reporting a result"
                            )
                    if failures and first_failure_at is None:
                        first_failure_at = time.monotonic()
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                if first_failure_at is None:
                    first_failure_at = time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=5.0 if not failures else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()

    missing = [r for r in range(world_size) if r not in values and r not in failures]
    if failures or missing:
        parts = [f"rank {r} raised:\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            why = "after a peer failed" if failures else f"within timeout_s={timeout_s}"
            parts.append(f"ranks {missing} did not finish {why} and were killed")
        raise RankFailed(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(parts))
    return [values[r] for r in range(world_size)]


def _dead_unreported(
    procs: list[Any], values: dict[int, Any], failures: dict[int, str]
) -> list[int]:
    """Ranks that died (segfault, os._exit, SIGKILL) without a report seen yet."""
    return [
        r
        for r, p in enumerate(procs)
        if r not in values and r not in failures and not p.is_alive() and p.exitcode != 0
    ]


def _drain(results: Any, values: dict[int, Any], failures: dict[int, str]) -> None:
    while True:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            return
        if ok:
            values[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
