"""Does the main job learn? Runs examples/grpo_adaptive_tp.py to completion per seed, reads its metrics.

    python benchmarks/demo_learning.py [--nproc 2] [--seeds 0 1] [--out benchmarks/results/demo_learning.json] [overrides ...]

Each seed is one full run (trainer.seed and data.seed set to it; the demo model is the same
cached build for all). Records, per seed, the training reward (math-verify, temperature 1) per
step, validation pass@1 (greedy) per validation, the share of responses that work the sum out,
and the wall time (the first run includes the demo build when it is not cached yet). Targets:
validation pass@1 at the end >= at the start + 0.15, and the mean training reward of the last 5
steps >= the first 5 + 0.15 (absolute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET_GAIN = 0.15
SHOWS_WORK = "reward/patrl_examples.demo.reward:shows_work/mean"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default="benchmarks/results/demo_learning.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    runs = [run_seed(seed, args.nproc, args.overrides) for seed in args.seeds]
    result = {
        "seeds": args.seeds,
        "runs": runs,
        "median_val_gain": statistics.median(r["val_gain"] for r in runs),
        "median_train_gain": statistics.median(r["train_gain"] for r in runs),
        "target_gain": TARGET_GAIN,
        "val_met_every_seed": all(r["val_gain"] >= TARGET_GAIN for r in runs),
        "train_met_every_seed": all(r["train_gain"] >= TARGET_GAIN for r in runs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table(runs))
    print(
        f"median gain over {len(runs)} seeds: validation {result['median_val_gain']:+.3f}, "
        f"training {result['median_train_gain']:+.3f} (target {TARGET_GAIN:+.2f}); wrote {out}"
    )


def run_seed(seed: int, nproc: int, overrides: list[str]) -> dict[str, Any]:
    run_root = Path(tempfile.mkdtemp(prefix=f"patrl-demo-seed{seed}-"))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        str(ROOT / "examples" / "grpo_adaptive_tp.py"),
        f"trainer.default_local_dir={run_root}", "trainer.resume_mode=disable",
        f"trainer.seed={seed}", f"data.seed={seed}", *overrides,
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, check=True)
    elapsed = time.perf_counter() - start

    metrics = next(run_root.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = series(rows, "critic/score/mean")
    val = series(rows, "val-core/acc/mean@1")
    rewards = [reward for _, reward in train]
    k = min(5, len(rewards) // 2)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return {
        "seed": seed,
        "command": command,
        "wall_s": elapsed,
        "train_reward_by_step": train,
        "val_pass_at_1_by_step": val,
        "shows_work_by_step": series(rows, SHOWS_WORK),
        "train_first_k_mean": first,
        "train_last_k_mean": last,
        "k": k,
        "train_gain": last - first,
        "val_first": val[0][1],
        "val_last": val[-1][1],
        "val_gain": val[-1][1] - val[0][1],
        "run_dir": str(metrics.parent),
    }


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if key in r]


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        f"{'seed':>4}  {'train first5':>12}  {'train last5':>11}  {'gain':>6}  "
        f"{'val start':>9}  {'val end':>7}  {'gain':>6}  {'wall s':>6}  validation pass@1 by step"
    ]
    for r in runs:
        curve = ", ".join(f"{s}: {v:.3f}" for s, v in r["val_pass_at_1_by_step"])
        lines.append(
            f"{r['seed']:>4}  {r['train_first_k_mean']:>12.3f}  {r['train_last_k_mean']:>11.3f}  "
            f"{r['train_gain']:>+6.3f}  {r['val_first']:>9.3f}  {r['val_last']:>7.3f}  "
            f"{r['val_gain']:>+6.3f}  {r['wall_s']:>6.0f}  {curve}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
