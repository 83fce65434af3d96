"""What would adaptive TP save on my run, and how many GPUs should its rollout use? Simulate
static layouts and the adaptive planner on a latency profile and a length log.

    python -m patrl.lenpredict.simulate --profile RUN/profile.json --lengths RUN/lengths.jsonl
    python -m patrl.lenpredict.simulate --roofline Qwen3-14B --lengths RUN/lengths.jsonl \\
        --sweep-gpus 1,2,4,8,16 --price-per-gpu-hour 2.5

Each rollout of the log (a step, or a round of one) is simulated on its own and the times are
summed. Without --policy every static TP size the world allows and `adaptive` are compared;
with --sweep-gpus the comparison runs for every rollout GPU count and prints time and
GPU-hours per step and the sweet spot (RLHFless's cost-aware scaling). Every number printed
is SIMULATED. `--help` describes the input formats.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from patrl.lenpredict.latency_model import LatencyModel
from patrl.lenpredict.layout import Layout, usable_tp_sizes
from patrl.lenpredict.length_predictor import LengthPredictor, PredictorConfig
from patrl.lenpredict.length_trace import (
    LengthRecord,
    PromptGroup,
    group_by_rollout,
    read_lengths,
)
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
from patrl.lenpredict.roofline import LLAMA31_8B, QWEN3_14B, roofline_profile
from patrl.lenpredict.speculation import SpeculativeTail

Knowledge = Literal["oracle", "predicted"]
ROOFLINES = {m.name: m for m in (LLAMA31_8B, QWEN3_14B)}
# --max-num-seqs 0: no cap but the replica's KV memory
UNCAPPED = 1 << 20

FORMATS = """\
input formats:
  --lengths FILE  JSONL, one sample a line; a run writes <run_dir>/lengths.jsonl:
      {"step": 3, "round": 0, "prompt_id": "17", "sample": 2, "prompt_tokens": 212,
       "response_tokens": 1834, "finish_reason": "stop"}
    step, round: optional (default 0); each (step, round) is one rollout, simulated on its
    own. prompt_id: the same prompt across steps (the length predictor learns from it).
    sample: 0..n-1, unique within its prompt's group; every sample of a group has its
    prompt's prompt_tokens. response_tokens >= 1. finish_reason: optional ("length" marks a
    sample cut at max_tokens; the longest of those bounds what the planner may predict).
    Unknown keys are errors; a bad line is reported as FILE:LINE.
  --profile FILE  a latency profile (JSON of patrl.lenpredict.Profile): <run_dir>/profile.json
    of a run, or one measured by `python -m patrl.rollout.profile --model DIR --out FILE`
    (under torchrun for TP > 1). Step times for sequences longer than the profile measured
    are extrapolated, with a warning.
  --roofline NAME instead of --profile: the calibrated 8xH100 model of NAME (SIMULATED;
    constants and their sources in benchmarks/README.md).
"""


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
    predictor: LengthPredictor, groups: list[PromptGroup], step: str
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


def _learn(predictor: LengthPredictor, groups: list[PromptGroup], step: str) -> None:
    """Feed a finished rollout's lengths in the order they finished (shortest first)."""
    samples = sorted(
        (n, g, i) for g, group in enumerate(groups) for i, n in enumerate(group.response_tokens)
    )
    for n, g, i in samples:
        predictor.observe_finished(f"{step}/{g}/{i}", f"{step}/{groups[g].prompt_id}", n)


def run_policy(
    spec: PolicySpec,
    steps: Mapping[Any, list[PromptGroup]],
    latency: LatencyModel,
    world_size: int,
    sim_config: SimConfig,
    planner_config: PlannerConfig,
    knowledge: Knowledge = "oracle",
    speculation: SpeculativeTail | None = None,
) -> list[SimResult]:
    """One SimResult per rollout of `steps` (in their order). With knowledge="predicted" an
    online LengthPredictor, trained on the earlier rollouts only, drives both prompt
    assignment and the planner. `speculation`: the replicas' tails speculate at this speed,
    and the planner prices it."""
    simulator = RolloutSimulator(latency, world_size, sim_config, speculation)
    predictor = LengthPredictor(PredictorConfig(quantiles=planner_config.quantile_levels))
    # only adaptive runs plan (a profile of one TP size prices no switch)
    planner = (
        ReconfigPlanner(latency, world_size, planner_config, speculation)
        if spec.tp is None
        else None
    )
    start = min(planner_config.candidate_tp)
    results = []
    for key, groups in steps.items():
        step = str(key)
        for group in groups:
            predictor.start_group(
                f"{step}/{group.prompt_id}", group.prompt_id, len(group.response_tokens)
            )
        predicted = None
        remaining: RemainingFn = oracle_remaining
        if knowledge == "predicted":
            predicted = [predictor.expected_length(g.prompt_id) for g in groups]
            remaining = _predicted_remaining(predictor, groups, step)
        if spec.tp is not None:
            policy: StaticPolicy | AdaptivePolicy = StaticPolicy(
                Layout(world_size // spec.tp, spec.tp)
            )
        else:
            assert planner is not None
            policy = AdaptivePolicy(planner, Layout(world_size // start, start), remaining)
        results.append(simulator.run(groups, policy, predicted))
        _learn(predictor, groups, step)
    return results


def compare(
    specs: list[PolicySpec],
    steps: Mapping[Any, list[PromptGroup]],
    latency: LatencyModel,
    world_size: int,
    sim_config: SimConfig,
    planner_config: PlannerConfig,
    knowledge: Knowledge = "oracle",
    speculation: SpeculativeTail | None = None,
) -> list[dict[str, Any]]:
    """Total simulated generation time of each policy, and its change against the best static
    policy among `specs` (`speculation`: as `run_policy`)."""
    rows: list[dict[str, Any]] = []
    for spec in specs:
        results = run_policy(
            spec, steps, latency, world_size, sim_config, planner_config, knowledge, speculation
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


def cost_sweep(
    gpu_counts: list[int],
    steps: Mapping[Any, list[PromptGroup]],
    latency: LatencyModel,
    node_size: int,
    sim_config: SimConfig,
    planner_config: PlannerConfig,
    knowledge: Knowledge = "oracle",
    price_per_gpu_hour: float = 1.0,
    idle_gpus: int = 0,
) -> dict[str, Any]:
    """For every rollout GPU count G: every static TP layout the profile and a node of
    `node_size` GPUs allow, and adaptive where two TP sizes fit; time per rollout (the mean),
    GPU-hours per rollout (G · time), and cost per rollout counting the `idle_gpus` that wait
    for it (a synchronous trainer's): price · (G + idle) · time. The sweet spots minimise
    that cost, over static layouts only and over all."""
    rows: list[dict[str, Any]] = []
    count = len(steps)
    for gpus in gpu_counts:
        tps = list(usable_tp_sizes(latency.tp_sizes, gpus, node_size))
        if not tps:
            continue
        specs = [PolicySpec(f"static:{tp}", tp) for tp in tps]
        if len(tps) > 1:
            specs.append(PolicySpec("adaptive", None))
        config = planner_config.model_copy(update={"candidate_tp": tuple(tps)})
        for row in compare(specs, steps, latency, gpus, sim_config, config, knowledge):
            seconds = row["total_s"] / count
            rows.append(
                {
                    "gpus": gpus,
                    "policy": row["policy"],
                    "time_s": seconds,
                    "gpu_hours": gpus * seconds / 3600,
                    "cost": price_per_gpu_hour * gpus * seconds / 3600,
                    "cost_with_idle": price_per_gpu_hour * (gpus + idle_gpus) * seconds / 3600,
                    "switches": row["switches"] / count,
                    "preemptions": row["preemptions"] / count,
                }
            )
    if not rows:
        raise ValueError(
            f"no GPU count in {gpu_counts} can hold a TP size of the profile "
            f"({latency.tp_sizes}) within nodes of {node_size}"
        )
    static = [r for r in rows if r["policy"].startswith("static")]
    return {
        "rows": rows,
        "sweet_spot_static": min(static, key=lambda r: r["cost_with_idle"]),
        "sweet_spot": min(rows, key=lambda r: r["cost_with_idle"]),
    }


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


def format_sweep(sweep: dict[str, Any], title: str, idle_gpus: int) -> str:
    lines = [
        title,
        f"{'gpus':>5} {'policy':<10} {'time_s/step':>12} {'GPU-h/step':>11} {'cost/step':>10} "
        f"{'incl. idle':>11} {'switches':>9}",
    ]
    for r in sweep["rows"]:
        lines.append(
            f"{r['gpus']:>5} {r['policy']:<10} {r['time_s']:>12.2f} {r['gpu_hours']:>11.4f} "
            f"{r['cost']:>10.4f} {r['cost_with_idle']:>11.4f} {r['switches']:>9.1f}"
        )
    for label, key in (
        ("static TP only", "sweet_spot_static"),
        ("adaptive TP allowed", "sweet_spot"),
    ):
        r = sweep[key]
        lines.append(
            f"sweet spot, {label}: {r['gpus']} GPUs {r['policy']}: {r['time_s']:.2f} s and "
            f"{r['gpu_hours']:.4f} GPU-h per step, cost {r['cost_with_idle']:.4f} per step "
            f"with {idle_gpus} idle GPU(s) waiting"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m patrl.lenpredict.simulate",
        description="Compare static TP layouts with adaptive TP, or sweep the rollout's GPU "
        "count, on a profile and a length log (SIMULATED).",
        epilog=FORMATS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", type=Path, help="latency profile JSON (see below)")
    source.add_argument(
        "--roofline", choices=sorted(ROOFLINES), help="the calibrated 8xH100 model of this model"
    )
    parser.add_argument("--lengths", required=True, type=Path, help="length log JSONL (below)")
    parser.add_argument(
        "--policy",
        action="append",
        default=None,
        help="static:<tp> or adaptive; repeatable (default: every static TP and adaptive)",
    )
    parser.add_argument(
        "--world-size", type=int, default=None, help="rollout GPUs (default: the profile's)"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="sequences a replica runs at once (0: only its KV memory limits them)",
    )
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
        "trained on the earlier rollouts",
    )
    parser.add_argument(
        "--finish-time",
        choices=["quantiles", "independent"],
        default="quantiles",
        help="how the planner prices predicted lengths (PlannerConfig.finish_time)",
    )
    parser.add_argument(
        "--max-rollouts",
        type=_positive_int,
        default=None,
        help="simulate only the log's last N rollouts",
    )
    parser.add_argument(
        "--sweep-gpus",
        default=None,
        help="comma-separated rollout GPU counts: time, GPU-hours and cost per step of each, "
        "and the sweet spot",
    )
    parser.add_argument("--price-per-gpu-hour", type=float, default=1.0)
    parser.add_argument(
        "--idle-gpus",
        type=int,
        default=0,
        help="GPUs that wait while the rollout runs (a synchronous trainer's): the sweet spot "
        "minimises price x (rollout GPUs + idle GPUs) x time",
    )
    parser.add_argument(
        "--spec-metrics",
        type=Path,
        default=None,
        help="a speculating run's metrics.jsonl: its tails speculate at the logged "
        "rollout/spec_acceptance and rollout/spec_tokens_per_step (SpeculativeTail."
        "from_metrics), and the planner prices it",
    )
    parser.add_argument(
        "--spec-max-num-seqs",
        type=int,
        default=16,
        help="with --spec-metrics: steps of at most this many sequences speculate "
        "(rollout.speculative.max_num_seqs)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return parser


def _positive_int(text: str) -> int:
    """argparse type: an integer of 1 or more (argparse names the flag on a refusal)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: accepted 1 or more")
    return value


def _load_profile(args: argparse.Namespace) -> Profile:
    if args.roofline:
        return roofline_profile(ROOFLINES[args.roofline])
    try:
        return Profile.load(args.profile)
    except OSError as err:
        raise SystemExit(f"--profile {args.profile}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise SystemExit(
            f"--profile {args.profile}: not a text file (byte {err.start} is not UTF-8); give "
            "a latency profile (JSON, as patrl.rollout.profile writes profile.json)"
        ) from err
    except ValueError as err:
        raise SystemExit(f"--profile {args.profile}: not a latency profile: {err}") from err


def _measured_context(profile: Profile) -> int:
    """The longest per-sequence context the profile's decode rows hold."""
    return max(r.max_context or r.context_tokens // r.batch for r in profile.decode)


def _warn_beyond_profile(records: list[LengthRecord], profile: Profile, path: Path) -> None:
    measured = _measured_context(profile)
    beyond = [r for r in records if r.prompt_tokens + r.response_tokens > measured]
    if beyond:
        longest = max(r.prompt_tokens + r.response_tokens for r in beyond)
        print(
            f"warning: {len(beyond)} of {len(records)} samples of {path} (up to {longest} "
            f"tokens) run past the longest context the profile measured ({measured} tokens a "
            "sequence); their step times are extrapolated",
            file=sys.stderr,
        )


def _response_cap(records: list[LengthRecord]) -> int:
    """max_tokens as the log shows it: the longest sample cut at it, else the longest."""
    cut = [r.response_tokens for r in records if r.finish_reason == "length"]
    return max(cut) if cut else max(r.response_tokens for r in records)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    profile = _load_profile(args)
    try:
        records = read_lengths(args.lengths)
    except OSError as err:
        raise SystemExit(f"--lengths {args.lengths}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise SystemExit(
            f"--lengths {args.lengths}: not a text file (byte {err.start} is not UTF-8); give "
            "a length log: JSONL, one sample a line, as a run writes <run_dir>/lengths.jsonl"
        ) from err
    except ValueError as err:
        raise SystemExit(f"--lengths: {err}") from err  # err names the file and line
    rollouts = group_by_rollout(records)
    if args.max_rollouts:
        rollouts = dict(list(rollouts.items())[-args.max_rollouts :])
    kept = {(r.step, r.round) for r in records} & set(rollouts)
    records = [r for r in records if r.rollout in kept]
    _warn_beyond_profile(records, profile, args.lengths)
    latency = LatencyModel.fit(profile)
    node = profile.hardware.num_devices
    world = args.world_size or node
    seqs = args.max_num_seqs or UNCAPPED
    longest = max(r.prompt_tokens + r.response_tokens for r in records)
    sim_config = SimConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or max(longest, 8192),
        memory_utilization=args.memory_utilization,
        plan_interval_steps=args.plan_interval_steps,
        assignment=args.assignment,
        max_response_length=_response_cap(records),
    )
    planner_config = PlannerConfig(
        candidate_tp=tuple(latency.tp_sizes),
        max_num_seqs=seqs,
        memory_utilization=args.memory_utilization,
        finish_time=args.finish_time,
    )
    what = (
        f"{profile.model.name} {profile.dtype} on {profile.hardware.name} ({profile.source} "
        f"profile), {len(records)} samples in {len(rollouts)} rollout(s), lengths "
        f"{args.lengths_known}, max_num_seqs {args.max_num_seqs or 'KV-limited'}"
    )
    if args.sweep_gpus:
        counts = [int(x) for x in args.sweep_gpus.split(",") if x.strip()]
        sweep = cost_sweep(
            counts, rollouts, latency, node, sim_config, planner_config, args.lengths_known,
            args.price_per_gpu_hour, args.idle_gpus,
        )  # fmt: skip
        title = f"SIMULATED cost sweep: {what}, price {args.price_per_gpu_hour}/GPU-hour"
        print(format_sweep(sweep, title, args.idle_gpus))
        if args.json:
            args.json.write_text(json.dumps({"title": title, **sweep}, indent=1))
        return 0
    tp_sizes = list(usable_tp_sizes(profile.tp_sizes, world, node))
    planner_config = planner_config.model_copy(update={"candidate_tp": tuple(tp_sizes)})
    names = args.policy or [f"static:{tp}" for tp in tp_sizes] + (
        ["adaptive"] if len(tp_sizes) > 1 else []
    )
    specs = [PolicySpec.parse(name) for name in names]
    for spec in specs:
        if spec.tp is not None and spec.tp not in tp_sizes:
            raise SystemExit(
                f"policy {spec.name}: the profile has tp in {tp_sizes} for world {world}"
            )
    speculation = None
    if args.spec_metrics:
        try:
            speculation = SpeculativeTail.from_metrics_log(
                args.spec_metrics, args.spec_max_num_seqs
            )
        except OSError as err:
            raise SystemExit(f"--spec-metrics {args.spec_metrics}: {err.strerror}") from err
        except ValueError as err:
            raise SystemExit(f"--spec-metrics: {err}") from err
        if speculation is None:
            raise SystemExit(
                f"--spec-metrics {args.spec_metrics}: no row has rollout/spec_acceptance and "
                "rollout/spec_tokens_per_step (the run did not speculate)"
            )
        what += f", speculating tail {speculation.record()}"
    rows = compare(
        specs, rollouts, latency, world, sim_config, planner_config, args.lengths_known,
        speculation,
    )  # fmt: skip
    title = f"SIMULATED generation time: {what}, world {world}"
    print(format_table(rows, title))
    if args.json:
        args.json.write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
