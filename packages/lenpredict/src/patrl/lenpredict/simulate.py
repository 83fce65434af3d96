"""What would adaptive TP save on my run? Simulate static layouts and the adaptive planner on a
latency profile and a length log, and print the comparison.

    python -m patrl.lenpredict.simulate --profile profile.json --lengths lengths.jsonl \\
        --policy static:2 --policy adaptive

Lengths are JSONL, one sample per line (see `patrl.lenpredict.length_trace`):
    {"step": 0, "prompt_id": "p17", "sample": 3, "prompt_tokens": 212, "response_tokens": 1834}
Each step is simulated as one rollout and the times are summed. Without --policy every static
TP size of the profile and `adaptive` are compared. Every number printed is SIMULATED.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from patrl.lenpredict.latency_model import LatencyModel
from patrl.lenpredict.layout import Layout, usable_tp_sizes
from patrl.lenpredict.length_predictor import LengthPredictor, PredictorConfig
from patrl.lenpredict.length_trace import PromptGroup, group_by_step, read_lengths
from patrl.lenpredict.planner import PlannerConfig, ReconfigPlanner
from patrl.lenpredict.profile_schema import Profile
from patrl.lenpredict.rollout_sim import (
    AdaptivePolicy,
    RemainingFn,
    RolloutSimulator,
    SimConfig,
    SimResult,
    SimSeq,
    StaticPolicy,
    oracle_remaining,
)

Knowledge = Literal["oracle", "predicted"]


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """`static:<tp>` or `adaptive` (starting from `start_tp`, the smallest TP by default)."""

    name: str
    tp: int | None  # None: adaptive

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        if text == "adaptive":
            return cls("adaptive", None)
        kind, _, tp = text.partition(":")
        if kind != "static" or not tp.isdigit():
            raise ValueError(f"unknown policy {text!r}; accepted: 'static:<tp>' or 'adaptive'")
        return cls(text, int(tp))


def _predicted_remaining(
    predictor: LengthPredictor, groups: list[PromptGroup], step: int
) -> RemainingFn:
    def remaining(seqs: list[SimSeq]) -> np.ndarray:
        return np.stack(
            [
                predictor.predict_remaining(
                    f"{step}/{s.seq_id}", f"{step}/{groups[s.group].prompt_id}", s.generated
                )
                for s in seqs
            ]
        )

    return remaining


def _learn(predictor: LengthPredictor, groups: list[PromptGroup], step: int) -> None:
    """Feed a finished rollout's lengths in the order they finished (shortest first)."""
    samples = sorted(
        (n, g, i) for g, group in enumerate(groups) for i, n in enumerate(group.response_tokens)
    )
    for n, g, i in samples:
        predictor.observe_finished(f"{step}/{g}/{i}", f"{step}/{groups[g].prompt_id}", n)


def run_policy(
    spec: PolicySpec,
    steps: dict[int, list[PromptGroup]],
    latency: LatencyModel,
    world_size: int,
    sim_config: SimConfig,
    planner_config: PlannerConfig,
    knowledge: Knowledge = "oracle",
) -> list[SimResult]:
    """One SimResult per step. With knowledge="predicted" an online LengthPredictor, trained on
    the earlier steps only, drives both prompt assignment and the planner."""
    simulator = RolloutSimulator(latency, world_size, sim_config)
    predictor = LengthPredictor(PredictorConfig())
    planner = ReconfigPlanner(latency, world_size, planner_config)
    start = min(planner_config.candidate_tp)
    results = []
    for step, groups in steps.items():
        for group in groups:
            predictor.start_group(
                f"{step}/{group.prompt_id}", group.prompt_id, len(group.response_tokens)
            )
        predicted = None
        remaining: RemainingFn = oracle_remaining
        if knowledge == "predicted":
            predicted = [predictor.expected_length(g.prompt_id) for g in groups]
            remaining = _predicted_remaining(predictor, groups, step)
        if spec.tp is None:
            policy: StaticPolicy | AdaptivePolicy = AdaptivePolicy(
                planner, Layout(world_size // start, start), remaining
            )
        else:
            policy = StaticPolicy(Layout(world_size // spec.tp, spec.tp))
        results.append(simulator.run(groups, policy, predicted))
        _learn(predictor, groups, step)
    return results


def compare(
    specs: list[PolicySpec],
    steps: dict[int, list[PromptGroup]],
    latency: LatencyModel,
    world_size: int,
    sim_config: SimConfig,
    planner_config: PlannerConfig,
    knowledge: Knowledge = "oracle",
) -> list[dict[str, Any]]:
    """Total simulated generation time of each policy, and its change against the best static
    policy among `specs`."""
    rows: list[dict[str, Any]] = []
    for spec in specs:
        results = run_policy(
            spec, steps, latency, world_size, sim_config, planner_config, knowledge
        )
        rows.append(
            {
                "policy": spec.name,
                "total_s": sum(r.total_s for r in results),
                "switches": sum(len(r.switches) for r in results),
                "preemptions": sum(r.preemptions for r in results),
            }
        )
    statics = [r["total_s"] for r in rows if r["policy"].startswith("static")]
    best = min(statics) if statics else None
    for row in rows:
        row["vs_best_static"] = row["total_s"] / best - 1 if best else None
    return rows


def format_table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [
        title,
        f"{'policy':<12} {'time_s':>10} {'vs_best_static':>15} {'switches':>9} {'preempt':>8}",
    ]
    for row in rows:
        delta = "" if row["vs_best_static"] is None else f"{100 * row['vs_best_static']:+.1f}%"
        lines.append(
            f"{row['policy']:<12} {row['total_s']:>10.2f} {delta:>15} "
            f"{row['switches']:>9} {row['preemptions']:>8}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m patrl.lenpredict.simulate",
        description="Compare static TP layouts with adaptive TP on a profile and a length log "
        "(SIMULATED).",
    )
    parser.add_argument("--profile", required=True, type=Path, help="latency profile JSON")
    parser.add_argument("--lengths", required=True, type=Path, help="lengths JSONL")
    parser.add_argument(
        "--policy",
        action="append",
        default=None,
        help="static:<tp> or adaptive; repeatable (default: every static TP and adaptive)",
    )
    parser.add_argument(
        "--world-size", type=int, default=None, help="default: the profile's devices"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="default: fits the longest sample"
    )
    parser.add_argument("--memory-utilization", type=float, default=0.9)
    parser.add_argument("--plan-interval-steps", type=int, default=64)
    parser.add_argument("--assignment", choices=["lpt", "round_robin"], default="lpt")
    parser.add_argument(
        "--lengths-known",
        choices=["oracle", "predicted"],
        default="oracle",
        help="oracle: the planner knows each sample's length; predicted: an online predictor "
        "trained on the earlier steps",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    profile = Profile.load(args.profile)
    latency = LatencyModel.fit(profile)
    world = args.world_size or profile.hardware.num_devices
    records = read_lengths(args.lengths)
    steps = group_by_step(records)
    longest = max(r.prompt_tokens + r.response_tokens for r in records)
    sim_config = SimConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or max(longest, 8192),
        memory_utilization=args.memory_utilization,
        plan_interval_steps=args.plan_interval_steps,
        assignment=args.assignment,
    )
    tp_sizes = list(usable_tp_sizes(profile.tp_sizes, world))
    planner_config = PlannerConfig(
        candidate_tp=tuple(tp_sizes),
        max_num_seqs=args.max_num_seqs,
        memory_utilization=args.memory_utilization,
    )
    names = args.policy or [f"static:{tp}" for tp in tp_sizes] + ["adaptive"]
    specs = [PolicySpec.parse(name) for name in names]
    for spec in specs:
        if spec.tp is not None and spec.tp not in tp_sizes:
            raise SystemExit(
                f"policy {spec.name}: the profile has tp in {tp_sizes} for world {world}"
            )
    rows = compare(specs, steps, latency, world, sim_config, planner_config, args.lengths_known)
    title = (
        f"SIMULATED generation time: {profile.model.name} {profile.dtype} on "
        f"{profile.hardware.name} ({profile.source} profile), world {world}, "
        f"{len(records)} samples in {len(steps)} step(s), lengths {args.lengths_known}"
    )
    print(format_table(rows, title))
    if args.json:
        args.json.write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
