"""Synchronous vs asynchronous GRPO (staleness 1, 2): steps per minute and reward after a fixed
wall-clock budget (issue 9, "Benchmark").

    OMP_NUM_THREADS=1 python benchmarks/async_bench.py [--steps 12] [--repeats 3] [--world 2]
    OMP_NUM_THREADS=1 python benchmarks/async_bench.py --task demo --world 3 [--steps 15]

--task demo runs the README's main job itself (examples/grpo_adaptive_tp.py under torchrun with
--world processes, the embedded demo model and task, examples/configs/demo.yaml), with
validation off, for --steps steps per mode: sync (colocated, adaptive TP where the world
allows), sync_partial (the same + rollout.over_sample_rate=0.25: partial rollouts), async_s1 and
async_s2 (--rollout-ranks generate, default world - 1, the rest train). The demo model is
warm-started by SFT, so its reward curve is the learning that matters; `first_reward` is the
reward of its first 3 steps. The demo assets are built once under $PATRL_CACHE_DIR (minutes).

--task tiny (the default): a random-init tiny Llama (2 layers, hidden 64, the demo tokenizer) on "a+b=?" prompts with
a dense reward a random model can climb (the share of digits in the response), n samples per
prompt. Modes on --world ranks: sync runs colocated on all ranks (generate, then train with
FSDP over all of them); async gives 1 rank to rollout and the rest to the trainer. sync_1rank
runs the sync loop on one rank: it separates what async gains by overlap from what it gains
by training without FSDP collectives (with --world 2 its trainer is a single process too).
Elapsed time at step k is the sum of the loop's own `timing_s/step` up to k (async: the
trainer's step including its wait for samples), so start-up is excluded alike. Reported per
mode, median over repeats (modes interleaved within a repeat so load drift on this shared
machine hits all alike): steps/min, mean training reward of the last 3 steps completed within
the budget (default: the median sync run's total time x 0.6), final reward, the trainer's wait
for samples, the rollout's wait for weights, mean staleness. Writes
benchmarks/results/async_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl_testkit.jobs import save_demo_llama, write_addition_task
from patrl_testkit.multirank import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
# mode -> (max_staleness or None for sync, ranks or None for --world)
MODES: dict[str, tuple[int | None, int | None]] = {
    "sync": (None, None),
    "sync_1rank": (None, 1),
    "async_s1": (1, None),
    "async_s2": (2, None),
}


def digit_reward(response: str, answer: str, **meta: Any) -> float:
    return sum(c.isdigit() for c in response) / max(1, len(response))


def build_assets(root: Path) -> Path:
    """The kit's tiny Llama with the demo tokenizer, and 256 training sums of two operands
    up to 99; kept once built."""
    if not (root / "model" / "config.json").is_file():
        save_demo_llama(root / "model")
        write_addition_task(root, {"train": 256}, max_operand=99)
    return root


def job(assets: Path, run_dir: Path, steps: int, staleness: int | None) -> Any:
    values: dict[str, Any] = {
        "model.path": assets / "model",
        "data.train_files": assets / "train.jsonl",
        "data.train_batch_size": 8,
        "data.max_prompt_length": 32,
        "data.max_response_length": 32,
        "actor.ppo_mini_batch_size": 8,
        "actor.optim.lr": 1e-3,
        "rollout.n": 8,
        "rollout.block_size": 8,
        "rollout.num_kv_blocks": 512,
        "rollout.adaptive_tp.enable": "false",
        "reward.functions": '[{name: "async_bench:digit_reward"}]',
        "reward.num_workers": 0,
        "trainer.total_training_steps": steps,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.resume_mode": "disable",
        "trainer.save_freq": 0,
        "trainer.default_local_dir": run_dir,
    }
    if staleness is not None:
        values.update(
            {
                "trainer.mode": "async",
                "async_rl.max_staleness": staleness,
                "async_rl.rollout_ranks": 1,
            }
        )
    return load_config(None, [f"{k}={v}" for k, v in values.items()])


def _rank(
    rank: int, world_size: int, assets: Path, run_dir: Path, steps: int, staleness: int | None
) -> list[dict[str, float]]:
    from patrl.orchestrator.async_loop import AsyncGRPO
    from patrl.orchestrator.sync_loop import SyncGRPO

    world = World(rank, world_size, rank, torch.device("cpu"))
    config = job(assets, run_dir, steps, staleness)
    args = (config, world, str(assets / "model"), config.data.train_files, None)
    loop = SyncGRPO(*args) if staleness is None else AsyncGRPO(*args)
    return loop.run().history


def run_mode(assets: Path, world: int, steps: int, staleness: int | None) -> list[dict[str, float]]:
    run_dir = RESULTS / "async_bench_runs" / f"{time.time_ns()}"
    histories = run_ranks(
        _rank, world_size=world, args=(assets, run_dir, steps, staleness), timeout_s=1800
    )
    history = next(h for h in histories if h)
    return [h for h in history if "critic/score/mean" in h]


DEMO_MODES: dict[str, list[str]] = {
    "sync": [],
    "sync_partial": ["rollout.over_sample_rate=0.25"],
    "async_s1": ["trainer.mode=async", "async_rl.max_staleness=1"],
    "async_s2": ["trainer.mode=async", "async_rl.max_staleness=2"],
}


def run_demo(world: int, steps: int, extra: list[str], rollout_ranks: int, seed: int) -> list[dict]:
    """The main job under torchrun; the training steps' metrics rows."""
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[1]
    run_root = Path(tempfile.mkdtemp(prefix="patrl-async-bench-"))
    if any(e.startswith("trainer.mode=async") for e in extra):
        extra = [*extra, f"async_rl.rollout_ranks={rollout_ranks}"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
        str(root / "examples" / "grpo_adaptive_tp.py"),
        f"trainer.default_local_dir={run_root}", "trainer.resume_mode=disable",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.plots=false",
        f"trainer.seed={seed}", f"data.seed={seed}", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    metrics = next(run_root.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if "critic/score/mean" in r]


def summarise(steps: list[dict[str, float]], budget_s: float) -> dict[str, float]:
    elapsed, t = [], 0.0
    for h in steps:
        t += h["timing_s/step"]
        elapsed.append(t)
    rewards = [h["critic/score/mean"] for h in steps]
    within = [r for r, e in zip(rewards, elapsed, strict=True) if e <= budget_s]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    return {
        "steps_per_min": 60.0 * len(steps) / elapsed[-1],
        "steps_in_budget": float(len(within)),
        "reward_at_budget": mean(within[-3:]),
        "final_reward": mean(rewards[-3:]),
        "first_reward": mean(rewards[:3]),
        "wait_for_batch_s": mean([h.get("time/wait_for_batch", 0.0) for h in steps]),
        "wait_for_weights_s": mean([h.get("time/wait_for_weights", 0.0) for h in steps]),
        "staleness_mean": mean([h.get("async/staleness_mean", 0.0) for h in steps]),
        "total_s": elapsed[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=None, help="default: 0.6 x median sync run")
    ap.add_argument("--task", choices=("tiny", "demo"), default="tiny")
    ap.add_argument("--rollout-ranks", type=int, default=None, help="async: default world - 1")
    ap.add_argument("--out", default=None, help="default: results/async_bench[_demo_w<world>].json")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    modes = list(DEMO_MODES if args.task == "demo" else MODES)
    runs: dict[str, list[list[dict[str, float]]]] = {m: [] for m in modes}
    assets = build_assets(RESULTS / "async_bench_assets") if args.task == "tiny" else None
    for r in range(args.repeats):
        for mode in modes:
            start = time.perf_counter()
            if assets is None:
                rollout_ranks = args.rollout_ranks or args.world - 1
                runs[mode].append(
                    run_demo(args.world, args.steps, DEMO_MODES[mode], rollout_ranks, seed=r)
                )
            else:
                staleness, ranks = MODES[mode]
                runs[mode].append(run_mode(assets, ranks or args.world, args.steps, staleness))
            print(f"repeat {r} {mode}: {time.perf_counter() - start:.0f} s wall", flush=True)
    sync_total = statistics.median(sum(h["timing_s/step"] for h in run) for run in runs["sync"])
    budget = args.budget_s if args.budget_s is not None else 0.6 * sync_total
    table: dict[str, dict[str, float]] = {}
    for mode in modes:
        per_run = [summarise(run, budget) for run in runs[mode]]
        table[mode] = {k: statistics.median(s[k] for s in per_run) for k in per_run[0]}
    base = table["sync"]["steps_per_min"]
    print(
        f"\n{args.task} task, world {args.world}, {args.steps} steps, budget {budget:.1f} s, "
        f"median of {args.repeats}"
    )
    cols = ("steps_per_min", "reward_at_budget", "final_reward", "first_reward",
            "wait_for_batch_s", "wait_for_weights_s", "staleness_mean")  # fmt: skip
    print(f"{'mode':12s} " + " ".join(f"{c:>18s}" for c in cols) + f" {'speed vs sync':>14s}")
    for mode, row in table.items():
        cells = " ".join(f"{row[c]:18.3f}" for c in cols)
        print(f"{mode:12s} {cells} {row['steps_per_min'] / base:14.2f}")
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "args": vars(args),
        "budget_s": budget,
        "table": table,
        "runs": runs,
    }
    name = "async_bench.json" if args.task == "tiny" else f"async_bench_demo_w{args.world}.json"
    path = Path(args.out) if args.out else RESULTS / name
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
