"""SIMULATED on a MEASURED profile: how much can adaptive TP gain over the best static layout
on this machine, whatever the workload?

    python benchmarks/crossover_ceiling.py [--profile benchmarks/results/adaptive_tp_profile_vocab_2l_h512.json]

The gain of folding replicas for the tail is bounded by the profile's crossover: how much
faster two tp-1 replicas run the full batch, and how much faster one tp-2 group runs the
tail. This script asks the rollout simulator, with the latency model fitted to a measured
2-rank profile (`adaptive_tp_bench.py` writes one per shape), for static (dp2, tp1), static
(dp1, tp2) and the planner told the true lengths (oracle), on:
- the adaptive bench's own workloads (uniform, long-tail, bimodal) at its size (16 prompts x
  4 samples) and twice it (16 x 8, 32 x 4);
- `LongTailSpec` (simulate_cluster's DeepScaleR-like lengths: per-prompt scale and failure
  rate, per-sample noise) scaled to the bench's 96-token cap, medians 12, 16 and 24, at the
  same three sizes.
Reported: each run's time and adaptive / best static; the minimum of that ratio is the most
the planner gains here. Also the planner against the best single fold from (dp2, tp1) to
(dp1, tp2) at a grid of sequence counts (simulate_cluster's ScriptedPlanner): how far the
planner's own choice of when to fold is from the best one (2026-11-24: within 1.2-1.8% on all 21, on two profiles).
Last, a bound no workload can beat (`patrl.lenpredict.adaptive_ceiling`): adaptive switching
for free at every step, on the two batch sizes in the proportion that favour it most.
Writes benchmarks/results/crossover_ceiling.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from patrl.lenpredict import (
    AdaptivePolicy,
    LatencyModel,
    Layout,
    Profile,
    PromptGroup,
    ReconfigPlanner,
    StaticPolicy,
    adaptive_ceiling,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import simulate_cluster as cluster  # sibling scripts and packages, not installed
from adaptive_tp import shapes, simulation, workloads

from patrl.rollout import AdaptiveTP

RESULTS = Path(__file__).parent / "results"
SIZES = ((8, 4), (8, 8), (16, 4))  # (prompts per replica, samples per prompt)
VOCAB = 151_936  # the vocab_2l family's; only the prompts' token ids depend on it
SCALE = shapes.scale_for("vocab_2l_h512", quick=False)
CHECK_EVERY = SCALE.check_every or AdaptiveTP().check_every


def bench_groups(prompts_per_replica: int, n: int) -> dict[str, list[PromptGroup]]:
    scale = dataclasses.replace(SCALE, prompts_per_replica=prompts_per_replica, n=n)
    return {w.name: w.prompt_groups() for w in workloads.make_workloads(scale, VOCAB)}


def deepscaler_groups(prompts: int, n: int, median: float) -> list[PromptGroup]:
    lengths = workloads.long_tail_lengths(prompts, n, median, SCALE.max_len, seed=0)
    # prompts of the bench's length
    return [PromptGroup(f"p{i}", 20, tuple(g)) for i, g in enumerate(lengths)]


def run(latency: LatencyModel, groups: list[PromptGroup]) -> dict[str, Any]:
    seqs = sum(len(g.response_tokens) for g in groups)
    simulator, planner_config = simulation.simulator_for(latency, SCALE, seqs, CHECK_EVERY)
    planner = ReconfigPlanner(latency, 2, planner_config)
    times = {
        "static_dp2_tp1": simulator.run(groups, StaticPolicy(Layout(2, 1))).total_s,
        "static_dp1_tp2": simulator.run(groups, StaticPolicy(Layout(1, 2))).total_s,
    }
    adaptive = simulator.run(groups, AdaptivePolicy(planner, start=Layout(2, 1)))
    times["adaptive_oracle"] = adaptive.total_s
    # the planner against every single fold, at most `count` sequences left, on a grid
    folds = [
        (
            simulator.run(
                groups,
                AdaptivePolicy(
                    cluster.ScriptedPlanner(latency, [(count, 2)], 2, planner_config),
                    start=Layout(2, 1),
                ),
            ).total_s,
            count,
        )
        for count in range(1, seqs + 1, max(1, seqs // 32))
    ]
    best_fold_s, best_count = min(folds)
    best = min(times["static_dp2_tp1"], times["static_dp1_tp2"])
    return {
        "sequences": seqs,
        "times_s": times,
        "adaptive_vs_best_static": adaptive.total_s / best,
        "switches": [list(s) for s in adaptive.switches],
        "best_scripted_fold": {"at_count": best_count, "seconds": best_fold_s},
        "adaptive_vs_best_of_all": adaptive.total_s / min(best, best_fold_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(RESULTS / "adaptive_tp_profile_vocab_2l_h512.json"))
    args = ap.parse_args()
    path = Path(args.profile)
    if not path.is_file():
        sys.exit(
            f"no profile at {path}: run `python benchmarks/adaptive_tp_bench.py --shapes "
            "vocab_2l_h512 --profile-only` first, or pass --profile"
        )
    latency = LatencyModel.fit(Profile.model_validate_json(path.read_text()))
    rows = []
    for per_replica, n in SIZES:
        cases = dict(bench_groups(per_replica, n))
        for median in (12.0, 16.0, 24.0):
            cases[f"deepscaler_median{median:.0f}"] = deepscaler_groups(2 * per_replica, n, median)
        for name, groups in cases.items():
            row = {"workload": name, "prompts": 2 * per_replica, "n": n, **run(latency, groups)}
            rows.append(row)
            t = row["times_s"]
            print(
                f"{name:<22} {2 * per_replica:>3} x {n}  dp2 {t['static_dp2_tp1']:6.2f}  "
                f"tp2 {t['static_dp1_tp2']:6.2f}  adaptive {t['adaptive_oracle']:6.2f} s  "
                f"x{row['adaptive_vs_best_static']:.3f}  vs best single fold "
                f"x{row['adaptive_vs_best_of_all']:.3f}"
            )
    # no workload at all: two batch sizes in the worst proportion, switches free
    bounds = {
        f"{seqs} sequences, {ctx} tokens each": dataclasses.asdict(
            adaptive_ceiling(latency, Layout(2, 1), Layout(1, 2), seqs, ctx)
        )
        for seqs in sorted({2 * p * n for p, n in SIZES})
        for ctx in (32, 96)
    }
    for name, bound in bounds.items():
        print(
            f"SIMULATED bound, {name}: x{bound['ratio']:.3f} (steps at {bound['wide_batch']} and "
            f"{bound['narrow_batch']} sequences, {bound['wide_share']:.0%} at the first)"
        )
    ceiling = min(r["adaptive_vs_best_static"] for r in rows)
    print(f"SIMULATED: the planner told the true lengths is at best x{ceiling:.3f} the best static")
    worst = max(r["adaptive_vs_best_of_all"] for r in rows)
    print(f"SIMULATED: and at worst x{worst:.3f} the best of static and every single fold")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "crossover_ceiling.json"
    payload = {
        "label": "SIMULATED on a MEASURED profile",
        "profile": str(path),
        "latency_model": {str(k): v for k, v in latency.describe().items()},
        "rows": rows,
        "best_adaptive_vs_best_static": ceiling,
        "workload_free_bound": bounds,
        "worst_adaptive_vs_best_of_all": worst,
    }
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
