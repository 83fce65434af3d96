"""The command line: arguments, starting the two ranks under torchrun, and the results file.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/adaptive_tp_bench.py [--quick]
    python benchmarks/adaptive_tp_bench.py [--quick]     (starts the torchrun above itself)
    python benchmarks/adaptive_tp_bench.py --report benchmarks/results/adaptive_tp_bench.json

Writes `benchmarks/results/adaptive_tp_bench[_quick].json` and prints the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from patrl.rollout import AdaptiveTP

from .config import ENTRY, BenchConfig
from .report import print_report, reprint, verdicts
from .run import run_shape
from .shapes import scale_for, shape_config


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny shape and workloads (~1-2 min)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-only", action="store_true", help="profile the shapes, then stop")
    ap.add_argument("--shapes", nargs="+", default=None, help="default: mqa_20l tiny (quick: tiny)")
    ap.add_argument(
        "--report", metavar="JSON", help="re-derive the verdicts of a results file and print it"
    )
    ap.add_argument(
        "--check-every",
        type=int,
        default=AdaptiveTP().check_every,
        help="decode steps per check",
    )
    ap.add_argument(
        "--reuse-profile",
        action="store_true",
        help="keep a shape's profile from an earlier run when it measured the same grids",
    )
    return ap.parse_args(argv)


def relaunch_under_torchrun(argv: Sequence[str]) -> None:
    """Start the two ranks of `benchmarks/adaptive_tp_bench.py argv` and exit with their status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    raise SystemExit(subprocess.call([*command, str(ENTRY), *argv], env=env))


def main(argv: Sequence[str] | None = None) -> None:
    """Run the bench as the command line asks; outside torchrun, start it under torchrun."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report:
        reprint(Path(args.report))
        return
    if "WORLD_SIZE" not in os.environ:
        relaunch_under_torchrun(argv)
    bench = BenchConfig(
        check_every=args.check_every,
        repeats=args.repeats,
        quick=args.quick,
        profile_only=args.profile_only,
        reuse_profile=args.reuse_profile,
    )
    shapes = args.shapes or (["tiny"] if args.quick else ["mqa_20l", "tiny"])
    for shape in shapes:
        shape_config(shape)  # exits naming an unknown shape
    torch.set_num_threads(1)  # two ranks share this machine's cores
    dist.init_process_group("gloo")
    try:
        if dist.get_world_size() != 2:
            raise SystemExit(
                f"run with torchrun --nproc_per_node 2, got world size {dist.get_world_size()}"
            )
        run_all(shapes, bench, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def run_all(shapes: Sequence[str], bench: BenchConfig, world: Any) -> None:
    """Run every shape; rank 0 writes the results file and prints the report."""
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, gloo, 2 ranks x 1 torch thread",
        "torch": torch.__version__,
        "loadavg_before": os.getloadavg(),
        "repeats": bench.repeats,
        "check_every": bench.check_every,
        "margin": bench.margin,
        "quick": bench.quick,
        "shapes": {},
    }
    start = time.perf_counter()
    for shape in shapes:
        scale = scale_for(shape, bench.quick)
        repeats = max(bench.repeats, scale.min_repeats)
        res = run_shape(shape, scale, repeats, world, bench)
        results["shapes"][shape] = {**res, "repeats": repeats}
    if bench.profile_only or dist.get_rank(world) != 0:
        return
    results["loadavg_after"] = os.getloadavg()
    results["wall_s"] = time.perf_counter() - start
    results["verdicts"] = verdicts(results)
    for res in results["shapes"].values():
        for w in res["workloads"].values():
            for p in w["policies"].values():
                p.pop("timeline", None)
    path = bench.results / f"adaptive_tp_bench{bench.suffix}.json"
    path.write_text(json.dumps(results, indent=1))
    print_report(results)
    print(
        f"\nwritten to {path}; load average before {results['loadavg_before']}, "
        f"after {results['loadavg_after']}"
    )
