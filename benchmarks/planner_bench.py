"""MEASURED: how long ReconfigPlanner.decide takes on the engine's hot path (target < 1 ms for
256 running sequences).

    OMP_NUM_THREADS=1 python benchmarks/planner_bench.py [--repeats 5] [--calls 300]

Cases, each from dp8xtp1 on 8 ranks (three candidate targets: the most work a call does),
remaining lengths as 3 quantiles:
- `stay`: the common call; staying and switching now are priced in every scenario;
- `switch`: the best switch clears the margin, so delaying it is priced too;
- `padded`: a latency model with a padded-context term (this machine's sdpa backend pays
  batch x longest context), which needs every replica's sequences in order of remaining length.
The first two use the roofline Llama-3.1-8B profile (no padded term, its knee past
max_num_seqs), `padded` a synthetic profile with both terms. Sequence counts 64, 256 and 1024.

Per case: the median over `calls` calls, `repeats` times; reported are the median of those
medians and each repeat's, on the wall clock and on this thread's CPU clock (which other
processes' load on a shared machine moves less).

`--compare-with REV` also times the `stay` and `switch` cases (256 sequences) of the lenpredict
source at git revision REV against the working tree's, each in its own fresh process,
alternating `repeats` times so load drifts hit both alike, and reports the ratio of medians.

Writes benchmarks/results/planner_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from patrl.lenpredict import (
    LLAMA31_8B,
    DecodeRow,
    LatencyModel,
    Layout,
    PlannerConfig,
    ReconfigPlanner,
    RunningSet,
    roofline_profile,
)

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 8


def padded_latency() -> LatencyModel:
    """The roofline profile with skewed rows whose step pays a padded-context term too."""
    profile = roofline_profile(LLAMA31_8B)
    skewed = []
    for row in profile.decode:
        if row.batch < 4:
            continue
        longest = 4 * row.context_tokens // row.batch
        extra = 2e-9 * (row.batch * longest - row.context_tokens)
        skewed.append(
            DecodeRow(
                tp=row.tp,
                batch=row.batch,
                context_tokens=row.context_tokens,
                max_context=longest,
                seconds=row.seconds + extra,
            )
        )
    latency = LatencyModel.fit(profile.model_copy(update={"decode": profile.decode + skewed}))
    assert all(fit.form != "total" for fit in latency.step_fits.values()), latency.describe()
    return latency


def running_set(n: int, seed: int = 0) -> RunningSet:
    rng = np.random.default_rng(seed)
    return RunningSet(
        seq_ids=np.arange(n),
        replica=rng.integers(0, WORLD, n),
        context=rng.integers(200, 8000, n),
        remaining=np.sort(rng.lognormal(7, 1, (n, 3)), axis=1),
    )


def time_decide(
    latency: LatencyModel, margin: float, n: int, repeats: int, calls: int
) -> dict[str, Any]:
    planner = ReconfigPlanner(latency, WORLD, PlannerConfig(margin=margin, max_num_seqs=1024))
    running = running_set(n)
    start = Layout(WORLD, 1)
    planner.new_rollout()
    action = planner.decide(running, start).action
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = [], []
        for _ in range(calls):
            planner.new_rollout()
            w0, c0 = time.perf_counter(), time.thread_time()
            planner.decide(running, start)
            c.append(time.thread_time() - c0)
            w.append(time.perf_counter() - w0)
        planner.decisions.clear()
        wall.append(statistics.median(w) * 1e6)
        cpu.append(statistics.median(c) * 1e6)
    return {
        "sequences": n,
        "action": action,
        "wall_us": statistics.median(wall),
        "cpu_us": statistics.median(cpu),
        "wall_us_per_repeat": wall,
        "cpu_us_per_repeat": cpu,
    }


def measure(repeats: int = 5, calls: int = 300, sizes: tuple[int, ...] = (64, 256, 1024)) -> dict:
    roofline = LatencyModel.fit(roofline_profile(LLAMA31_8B))
    cases = {"stay": (roofline, 1e9), "switch": (roofline, 0.2), "padded": (padded_latency(), 0.2)}
    result: dict[str, Any] = {"loadavg_before": os.getloadavg(), "cases": {}}
    for name, (latency, margin) in cases.items():
        result["cases"][name] = [time_decide(latency, margin, n, repeats, calls) for n in sizes]
    result["loadavg_after"] = os.getloadavg()
    return result


ROOT = Path(__file__).resolve().parents[1]
SRC = "packages/lenpredict/src"


def one_process(src: Path, case: str, calls: int) -> dict[str, float]:
    """time_decide of one case in a fresh interpreter importing lenpredict from `src`."""
    margin = 1e9 if case == "stay" else 0.2
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]);"
        "import planner_bench as b;"
        "from patrl.lenpredict import LLAMA31_8B, LatencyModel, roofline_profile;"
        "lat = LatencyModel.fit(roofline_profile(LLAMA31_8B));"
        f"print(json.dumps(b.time_decide(lat, {margin}, 256, 1, {calls})))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", code, str(src), str(Path(__file__).parent)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(rev: str, repeats: int, calls: int) -> dict[str, Any]:
    """Median over alternating fresh processes of REV's and the working tree's decide()."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "src.tar"
        subprocess.run(["git", "archive", "-o", str(archive), rev, SRC], cwd=ROOT, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        sources = {rev: Path(tmp) / SRC, "working tree": ROOT / SRC}
        result: dict[str, Any] = {}
        for case in ("stay", "switch"):
            samples: dict[str, list[float]] = {name: [] for name in sources}
            for _ in range(repeats):
                for name, src in sources.items():
                    samples[name].append(one_process(src, case, calls)["wall_us"])
            medians = {name: statistics.median(v) for name, v in samples.items()}
            result[case] = {
                "wall_us_per_process": samples,
                "median_wall_us": medians,
                "ratio_working_over_rev": medians["working tree"] / medians[rev],
            }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--compare-with", default=None, metavar="REV")
    args = parser.parse_args()
    if args.compare_with:
        versus = compare(args.compare_with, args.repeats, args.calls)
        print(f"decide(), 256 seqs: {args.compare_with} vs working tree, wall us, fresh processes")
        for case, r in versus.items():
            print(
                f"  {case:<7} {r['median_wall_us']} ratio {r['ratio_working_over_rev']:.2f} "
                f"({r['wall_us_per_process']})"
            )
    result = measure(args.repeats, args.calls)
    if args.compare_with:
        result["compare_with"] = {"rev": args.compare_with, **versus}
    print(
        f"MEASURED ReconfigPlanner.decide on {platform.machine()} ({platform.processor() or '?'}), "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, load average "
        f"{result['loadavg_before'][0]:.1f} -> {result['loadavg_after'][0]:.1f}"
    )
    print(f"{'case':<8} {'seqs':>5} {'action':>7} {'wall us':>8} {'cpu us':>7}  per-repeat wall")
    for name, rows in result["cases"].items():
        for r in rows:
            print(
                f"{name:<8} {r['sequences']:>5} {r['action']:>7} {r['wall_us']:>8.0f} "
                f"{r['cpu_us']:>7.0f}  {[round(x) for x in r['wall_us_per_repeat']]}"
            )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "planner_bench.json"
    out.write_text(json.dumps({**result, "machine": platform.platform()}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
