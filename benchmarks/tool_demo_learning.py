"""Does the tool demo learn? Runs examples/grpo_tools.py per seed and reads its metrics.

    python benchmarks/tool_demo_learning.py [--task addition|long_sums] [--nproc 2] [--seeds 0]
        [--out benchmarks/results/tool_demo_learning[_long_sums].json] [overrides ...]

`--task` is examples/grpo_tools.py's: the plain demo's addition task, or long sums (2-4
numbers of 10-999) on which the calculator pays. Per seed: validation pass@1 (greedy, multi-turn) per validation, and per training step the
share of responses that call the calculator (`calls_tool`) and, of those, the share whose
every call is well-formed (`well_formed_call / calls_tool`: closed, valid JSON, the calculator
with an expression), the share of all responses that call with well-formed calls only, and
training correctness (math_verify), first and last 5 steps averaged. Also plots them per seed (tool_use.png in
the run's folder, beside the job's own reward / length / timeline plots, and a copy beside the
JSON: `<json stem>_seed<N>.png`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CALLS = "reward/patrl_examples.demo.reward:calls_tool/mean"
WELL_FORMED = "reward/patrl_examples.demo.reward:well_formed_call/mean"
CORRECT = "reward/math_verify/mean"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=("addition", "long_sums"), default="addition")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    suffix = "" if args.task == "addition" else f"_{args.task}"
    out = Path(args.out or f"benchmarks/results/tool_demo_learning{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:
        run = run_seed(seed, args.task, args.nproc, args.overrides)
        plot_copy = out.parent / f"{out.stem}_seed{seed}.png"
        shutil.copyfile(Path(run["run_dir"]) / "tool_use.png", plot_copy)
        runs.append({**run, "plot": str(plot_copy)})
    out.write_text(json.dumps({"task": args.task, "seeds": args.seeds, "runs": runs}, indent=2))
    for r in runs:
        print(
            f"seed {r['seed']}: val pass@1 {r['val_first']:.3f} -> {r['val_last']:.3f}; "
            f"calls the calculator {r['calls_first']:.3f} -> {r['calls_last']:.3f}; "
            f"well-formed share of calling responses {fmt(r['well_formed_first'])} -> "
            f"{fmt(r['well_formed_last'])}; calls, all well-formed "
            f"{r['calls_well_formed_first']:.3f} -> {r['calls_well_formed_last']:.3f}; "
            f"correct {r['correct_first']:.3f} -> {r['correct_last']:.3f} "
            f"(first / last {r['k']} steps); "
            f"{r['wall_s']:.0f} s; validation by step: "
            + ", ".join(f"{s}: {v:.3f}" for s, v in r["val_pass_at_1_by_step"])
        )
    print(f"wrote {out}")


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def run_seed(seed: int, task: str, nproc: int, overrides: list[str]) -> dict[str, Any]:
    run_root = Path(tempfile.mkdtemp(prefix=f"patrl-tool-demo-{task}-seed{seed}-"))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        str(ROOT / "examples" / "grpo_tools.py"), "--task", task,
        f"trainer.default_local_dir={run_root}", "trainer.resume_mode=disable",
        f"trainer.seed={seed}", f"data.seed={seed}", *overrides,
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, check=True)
    elapsed = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_root / "metrics.jsonl").read_text().splitlines()]
    val = series(rows, "val-core/acc/mean@1")
    calls = series(rows, CALLS)
    well = series(rows, WELL_FORMED)
    correct = series(rows, CORRECT)
    k = min(5, len(calls) // 2)
    plot(calls, well, val, run_root / "tool_use.png", f"{task}, seed {seed}")
    return {
        "task": task,
        "seed": seed,
        "command": command,
        "wall_s": elapsed,
        "val_pass_at_1_by_step": val,
        "calls_tool_by_step": calls,
        "well_formed_call_by_step": well,
        "k": k,
        "val_first": val[0][1],
        "val_last": val[-1][1],
        "calls_first": mean([v for _, v in calls[:k]]),
        "calls_last": mean([v for _, v in calls[-k:]]),
        "well_formed_first": ratio(well[:k], calls[:k]),
        "well_formed_last": ratio(well[-k:], calls[-k:]),
        # Responses that call with only well-formed calls, over all responses.
        "calls_well_formed_first": mean([v for _, v in well[:k]]),
        "calls_well_formed_last": mean([v for _, v in well[-k:]]),
        # Training rollouts' math_verify: right answers over all responses.
        "correct_first": mean([v for _, v in correct[:k]]),
        "correct_last": mean([v for _, v in correct[-k:]]),
        "run_dir": str(run_root),
    }


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if key in r]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def ratio(num: list[tuple[int, float]], den: list[tuple[int, float]]) -> float | None:
    """Well-formed calling responses over calling responses, pooled over the steps."""
    d = sum(v for _, v in den)
    return sum(v for _, v in num) / d if d > 0 else None


def plot(calls: Any, well: Any, val: Any, path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot([s for s, _ in calls], [v for _, v in calls], "o-", ms=3, label="calls the calculator")
    shares = [(s, w / c) for (s, w), (_, c) in zip(well, calls, strict=True) if c > 0]
    ax.plot(
        [s for s, _ in shares], [v for _, v in shares], "^-", ms=3, label="of those, well-formed"
    )
    ax.plot([s for s, _ in val], [v for _, v in val], "s--", ms=5, label="validation pass@1")
    ax.set_xlabel("step")
    ax.set_ylabel("share")
    ax.set_title(f"tool use by step (training rollouts; {title})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
