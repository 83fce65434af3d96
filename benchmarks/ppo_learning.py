"""Does the RLHF demo learn? Runs examples/rlhf_ppo.py to completion per seed, reads its metrics.

    python benchmarks/ppo_learning.py [--nproc 1] [--seeds 0 1 2] [--out benchmarks/results/ppo_learning.json] [overrides ...]

Each seed is one full run of the three stages (the SFT model is the same cached build for all;
the reward model's pairs and head, trainer.seed and data.seed follow the seed). Records, per
seed: the RM's held-out accuracy (stage 2), and over the run (stage 3) the RM score
(reward_model/score/mean), the verifiable accuracy (val-core/acc/mean@1, greedy, math-verify),
the share of worked responses and critic/vf_explained_var when the run logs it. Targets (issue
31): RM held-out accuracy >= 0.8; the RM score and the verifiable accuracy rise (mean of the
last k > mean of the first k, k = 5 training steps / the first and last validation); explained
variance > 0 at the end (mean of the last 5 steps).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET_RM_ACC = 0.8
RM_SCORE = "reward_model/score/mean"
VAL = "val-core/acc/mean@1"
EXPLAINED_VAR = "critic/vf_explained_var"
SHOWS_WORK = "reward/patrl_examples.demo.reward:shows_work/mean"
_RM_LINE = re.compile(r"\[rlhf\] stage 2: reward model \S+ held-out accuracy ([0-9.]+)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="benchmarks/results/ppo_learning.json")
    parser.add_argument("overrides", nargs="*", help="passed to examples/rlhf_ppo.py")
    args = parser.parse_args()

    runs = [run_seed(seed, args.nproc, args.overrides) for seed in args.seeds]
    result = {
        "seeds": args.seeds,
        "runs": runs,
        "target_rm_accuracy": TARGET_RM_ACC,
        "median_rm_accuracy": statistics.median(r["rm_accuracy"] for r in runs),
        "median_rm_score_gain": statistics.median(r["rm_score_gain"] for r in runs),
        "median_val_gain": statistics.median(r["val_gain"] for r in runs),
        "met_every_seed": {key: all(r["met"][key] for r in runs) for key in runs[0]["met"]},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table(runs))
    print(f"targets met on every seed: {result['met_every_seed']}; wrote {out}")


def run_seed(seed: int, nproc: int, overrides: list[str]) -> dict[str, Any]:
    run_root = Path(tempfile.mkdtemp(prefix=f"patrl-rlhf-seed{seed}-"))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        str(ROOT / "examples" / "rlhf_ppo.py"), "--rm-seed", str(seed),
        f"trainer.default_local_dir={run_root}", "trainer.resume_mode=disable",
        f"trainer.seed={seed}", f"data.seed={seed}", *overrides,
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    print(done.stdout, end="")
    found = _RM_LINE.search(done.stdout)
    if found is None:
        raise RuntimeError(f"seed {seed}: the example printed no stage-2 accuracy line")

    metrics = next(run_root.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rm_score, val = series(rows, RM_SCORE), series(rows, VAL)
    explained = series(rows, EXPLAINED_VAR)
    rm_gain = last_minus_first([v for _, v in rm_score], 5)
    val_gain = val[-1][1] - val[0][1]
    ev_end = mean_last([v for _, v in explained], 5) if explained else None
    return {
        "seed": seed,
        "command": command,
        "wall_s": elapsed,
        "rm_accuracy": float(found.group(1)),
        "rm_score_by_step": rm_score,
        "val_acc_by_step": val,
        "shows_work_by_step": series(rows, SHOWS_WORK),
        "explained_var_by_step": explained,
        "rm_score_gain": rm_gain,
        "val_first": val[0][1],
        "val_last": val[-1][1],
        "val_gain": val_gain,
        "explained_var_end": ev_end,
        "met": {
            "rm_accuracy": float(found.group(1)) >= TARGET_RM_ACC,
            "rm_score_rises": rm_gain > 0,
            "val_rises": val_gain > 0,
            # None when no critic ran (the fallback stage 3): not met, not hidden.
            "explained_var_positive": ev_end is not None and ev_end > 0,
        },
        "run_dir": str(metrics.parent),
    }


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if key in r]


def mean_last(values: list[float], k: int) -> float:
    tail = values[-min(k, len(values)) :]
    return sum(tail) / len(tail)


def last_minus_first(values: list[float], k: int) -> float:
    k = max(1, min(k, len(values) // 2))
    return sum(values[-k:]) / k - sum(values[:k]) / k


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        f"{'seed':>4}  {'RM acc':>6}  {'RM score gain':>13}  {'val start':>9}  {'val end':>7}  "
        f"{'EV end':>7}  {'wall s':>6}  validation acc by step"
    ]
    for r in runs:
        ev = "-" if r["explained_var_end"] is None else f"{r['explained_var_end']:.3f}"
        curve = ", ".join(f"{s}: {v:.3f}" for s, v in r["val_acc_by_step"])
        lines.append(
            f"{r['seed']:>4}  {r['rm_accuracy']:>6.3f}  {r['rm_score_gain']:>+13.3f}  "
            f"{r['val_first']:>9.3f}  {r['val_last']:>7.3f}  {ev:>7}  {r['wall_s']:>6.0f}  {curve}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
