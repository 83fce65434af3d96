"""Simulated vs measured total generation time on this machine (static layouts), and the
profiler's cost and latency-model error here.

    python benchmarks/simulator_fidelity.py [--repeats 5] [--requests 24]

MEASURED and SIMULATED side by side: a tiny random Llama (2 layers, hidden 64, fp32, CPU,
1 torch thread) generates 24 requests of long-tailed forced lengths (lognormal, median ~24,
up to 240 tokens) with continuous batching (max_num_seqs 8); the RolloutSimulator is fed the
run's lengths and a profile of this machine measured just before by patrl.rollout.profile.
DP=1 is one engine; DP=2 is two independent engines run one after the other (the measured
total is the slower one). Each repeat profiles, runs and simulates in turn, so load drifts on
this shared machine hit both sides alike; the tables report medians over repeats of the
simulated/measured ratio, per clock (wall: what a rollout waits; cpu: this thread's CPU time,
which other processes' load moves less). The schedules (prefill count and every decode step's
batch) are also compared; they must be identical.

Writes benchmarks/results/simulator_fidelity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# the test module holds the experiment; this reruns it with timing
from test_simulator_fidelity import (
    TOLERANCE,
    build_model,
    fidelity_grid,
    long_tail_groups,
    measure,
    measured_total,
    simulated_steps,
)

from patrl.lenpredict import held_out_error

RESULTS = Path(__file__).resolve().parent / "results"


def one_setting(model: Path, dp: int, clock: str, repeats: int, requests: int) -> dict[str, Any]:
    start = time.perf_counter()
    runs, sims, profiles = measure(model, long_tail_groups(requests), dp, clock, repeats)
    same_schedule = all(
        simulated_steps(sim, i) == (run.prefill_steps, run.decode_batches)
        for replicas, sim in zip(runs, sims, strict=True)
        for i, run in enumerate(replicas)
    )
    measured = [measured_total(r) for r in runs]
    simulated = [s.total_s for s in sims]
    ratios = [s / m for s, m in zip(simulated, measured, strict=True)]
    held_out = [held_out_error(p, seed=seed)[1] for p in profiles for seed in range(5)]
    return {
        "dp": dp,
        "clock": clock,
        "measured_s": measured,
        "simulated_s": simulated,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "within_tolerance": abs(statistics.median(ratios) - 1) <= TOLERANCE,
        "same_schedule": same_schedule,
        "latency_model_held_out_mape_median": statistics.median(held_out),
        "seconds": time.perf_counter() - start,
        "loadavg": os.getloadavg(),
    }


def profile_cost(model: Path) -> dict[str, Any]:
    """Wall time of the profiler's quick grid (TP 1, in process; torch already imported)."""
    from patrl.rollout import EngineConfig
    from patrl.rollout.profile import profile_single, quick_grid

    base = EngineConfig(model=str(model), dtype="float32", device="cpu")
    start = time.perf_counter()
    profile = profile_single(base, quick_grid())
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    profile_single(base, fidelity_grid("wall"))
    return {
        "quick_grid_s": seconds,
        "quick_grid_rows": len(profile.decode) + len(profile.prefill),
        "fidelity_grid_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import tempfile

    model = build_model(Path(tempfile.mkdtemp()))
    report: dict[str, Any] = {"profile_cost": profile_cost(model), "settings": []}
    print(f"profiler cost (wall, TP 1): {report['profile_cost']}")
    print(f"{'clock':<5} {'dp':>2} {'measured s':>11} {'simulated s':>12} {'sim/meas':>9} "
          f"{'ok':>3} {'schedule':>8} {'held-out':>8} {'load':>5}")  # fmt: skip
    for clock in ("wall", "cpu"):
        for dp in (1, 2):
            row = one_setting(model, dp, clock, args.repeats, args.requests)
            report["settings"].append(row)
            print(
                f"{clock:<5} {dp:>2} {statistics.median(row['measured_s']):>11.3f} "
                f"{statistics.median(row['simulated_s']):>12.3f} {row['median_ratio']:>9.3f} "
                f"{'yes' if row['within_tolerance'] else 'NO':>3} "
                f"{'same' if row['same_schedule'] else 'DIFF':>8} "
                f"{row['latency_model_held_out_mape_median']:>8.3f} {row['loadavg'][0]:>5.1f}",
                flush=True,
            )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "simulator_fidelity.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
