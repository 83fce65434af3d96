"""Does the main job learn? Runs examples/grpo_adaptive_tp.py to completion, reads its metrics.

    python benchmarks/demo_learning.py [--nproc 2] [--out benchmarks/results/demo_learning.json] [overrides ...]

Records the training reward per step, validation pass@1, and the time the run took, and
compares the mean reward of the last 5 steps with the first 5 (target: +0.15 absolute).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/demo_learning.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    run_root = Path(tempfile.mkdtemp(prefix="patrl-demo-"))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
        str(ROOT / "examples" / "grpo_adaptive_tp.py"),
        f"trainer.default_local_dir={run_root}", "trainer.resume_mode=disable", *args.overrides,
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, check=True)
    elapsed = time.perf_counter() - start

    metrics = next(run_root.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["critic/score/mean"]) for r in rows if "critic/score/mean" in r]
    val = [(r["step"], r["val-core/acc/mean@1"]) for r in rows if "val-core/acc/mean@1" in r]
    rewards = [reward for _, reward in train]
    k = min(5, len(rewards) // 2)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    result = {
        "command": command,
        "wall_s_including_build_if_uncached": elapsed,
        "train_reward_by_step": train,
        "val_pass_at_1_by_step": val,
        "first_k_mean": first,
        "last_k_mean": last,
        "k": k,
        "gain": last - first,
        "target_gain": 0.15,
        "met": last - first >= 0.15,
        "run_dir": str(metrics.parent),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"reward: first {k} steps {first:.3f}, last {k} steps {last:.3f}, gain {last - first:+.3f} (target +0.15)"
    )
    print("validation pass@1: " + ", ".join(f"step {int(s)}: {v:.3f}" for s, v in val))
    print(f"wall time {elapsed:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
