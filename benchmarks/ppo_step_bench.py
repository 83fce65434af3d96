"""What the critic costs: step time of PPO with a critic (gae) against GRPO on the demo shape.

    python benchmarks/ppo_step_bench.py [--steps 6] [--pairs 2] [--out benchmarks/results/ppo_step.json] [overrides ...]

Runs examples/grpo_adaptive_tp.py in one process per run (the demo config: 16 prompts x 8
samples, up to 256 tokens, one optimizer step per batch), GRPO and gae alternating as whole
runs (`--pairs` rounds), and reads each step's `timing_s/*` from metrics.jsonl, the first step
dropped as warm-up. Variants: grpo; gae (one critic step, its forward gives the values); gae_2mini (two critic
mini-batches: a values pass first). Reports the median of each phase per variant (generate, reward, values,
critic update, actor update, weight sync, step) and the critic's update over the actor's (the
actor's is one forward + backward of the same backbone plus its LM head and logprobs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PHASES = (
    "gen",
    "reward",
    "old_log_prob",
    "values",
    "update_critic",
    "update_actor",
    "update_weights",
    "step",
)
_GAE = ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-4"]
# gae: one critic step per batch (its update's forward gives the values); gae_2mini: two
# critic mini-batches, so a no-grad values pass runs first (the actor unchanged).
VARIANTS = {"grpo": [], "gae": _GAE, "gae_2mini": [*_GAE, "critic.ppo_mini_batch_size=8"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/ppo_step.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    steps: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for _ in range(args.pairs):
        for name, extra in VARIANTS.items():
            steps[name] += run(args.steps, [*extra, *args.overrides])
    medians = {name: phase_medians(rows) for name, rows in steps.items()}
    g, p, two = medians["grpo"], medians["gae"], medians["gae_2mini"]
    result = {
        "steps_per_run": args.steps,
        "pairs": args.pairs,
        "medians_s": medians,
        "step_ratio_gae_over_grpo": p["step"] / g["step"],
        "critic_update_over_actor_update": p["update_critic"] / p["update_actor"],
        "values_pass_over_critic_update_2mini": two["values"] / two["update_critic"],
        "step_ratio_gae_2mini_over_grpo": two["step"] / g["step"],
        "torch_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table(medians))
    print(
        f"step gae / grpo {result['step_ratio_gae_over_grpo']:.2f}; critic update / actor "
        f"update {result['critic_update_over_actor_update']:.2f}; wrote {out}"
    )


def run(steps: int, overrides: list[str]) -> list[dict[str, float]]:
    """One whole run of the demo job; its steps' timings, the first dropped."""
    run_root = Path(tempfile.mkdtemp(prefix="patrl-ppo-bench-"))
    command = [
        sys.executable, str(ROOT / "examples" / "grpo_adaptive_tp.py"),
        f"trainer.default_local_dir={run_root}", "trainer.resume_mode=disable",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.plots=false",
        "trainer.logger=[jsonl]", *overrides,
    ]  # fmt: skip
    subprocess.run(command, check=True)
    metrics = next(run_root.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if "timing_s/step" in r][1:]


def phase_medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {p: statistics.median(r.get(f"timing_s/{p}", 0.0) for r in rows) for p in PHASES}


def table(medians: dict[str, dict[str, float]]) -> str:
    lines = ["| phase | " + " | ".join(medians) + " |", "|---" * (len(medians) + 1) + "|"]
    for p in PHASES:
        lines.append(f"| {p} | " + " | ".join(f"{m[p]:.3f}" for m in medians.values()) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
