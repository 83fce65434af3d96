"""SIMULATED: adaptive TP against every static layout for GRPO rollouts on one 8xH100 node (the
PAT setting), at both admission caps and at the KV-memory limit, with the gain split into its
parts; the planner's finish-time pricing; and how many GPUs the rollout should use.

    OMP_NUM_THREADS=1 python benchmarks/simulate_cluster.py     # about five minutes
    OMP_NUM_THREADS=1 python benchmarks/simulate_cluster.py --speculation  # its part alone

Everything this script reports about generation time is a simulation: the calibrated roofline
of an 8xH100 SXM5 node (patrl.lenpredict.roofline; constants fitted to published measurements,
patrl.lenpredict.calibration, table in benchmarks/README.md), the rollout simulator
(continuous batching, KV budget at 90% of HBM), and a synthetic DeepScaleR-like length
distribution. Only the planner call latency is measured, on the machine running the script.

Setting
- Models: Llama-3.1-8B and Qwen3-14B in bfloat16, 8 GPUs, TP in {1, 2, 4, 8}.
- Batch: 128 prompts x 8 samples (GRPO), 3 steps over the same 128 prompts (prompts recur
  across epochs, which is what the length predictor learns from).
- Lengths: LongTailSpec() of patrl.lenpredict.length_trace, stated exactly there: per prompt a
  log-normal scale (median 2000 tokens, sigma 0.5) and a failure rate U(0, 0.6); failed
  samples 3x longer (DeepScaleR's authors report wrong answers ~3x longer than right ones);
  per-sample log-normal noise (sigma 0.4); capped at max_response_length=16384 (DeepScaleR's
  16K stage).
- Caps: max_num_seqs=256 per replica (RLBoost's verl+vLLM artifact), 1024 (verl's rollout
  default), and none (only the replica's KV memory limits it).
- verl default: actor_rollout_ref.rollout.tensor_model_parallel_size=2 (verl's
  ppo_trainer.yaml), prompts split evenly across replicas (round-robin).
- Policies: static TP 1/2/4/8 with round-robin assignment (what verl does) and with the
  length-aware LPT assignment; adaptive (LPT + the ReconfigPlanner, opening where its first
  check says) with oracle lengths, and with the online LengthPredictor (trained only on
  earlier steps) under both finish-time pricings (comonotone quantiles; the longest of
  independent samples).
- Decomposition, in points of verl's time: better static choice (verl's TP 2 -> the best
  static TP, round-robin), length-aware assignment (-> the best static TP with LPT), adaptive
  folds (-> adaptive, oracle lengths).

- Speculating tail (issue 44): the same GRPO steps at cap 256 with every replica's decode
  steps of at most 16 sequences speculating, at acceptances MEASURED by benchmarks/spec_bench.py
  on this CPU (benchmarks/README.md, "Speculative rollouts"): the demo SFT model at T = 1,
  second epoch (acceptance 0.45, 1.19 tokens per sample step) and the random Llama, greedy,
  second epoch (0.78, 1.32). Each twice: "as logged" (SpeculativeTail.from_metrics: the
  logged tokens per step count every decode step, the bulk's too, so a lower bound on the
  tail's speed) and "chain" (SpeculativeTail.from_acceptance: a draft always found, its
  length by the drafter's adaptive rule: an upper bound). The verify price comes from verify
  rows the roofline adds (StepModel.verify_step; its two ASSUMPTIONs in its docstring). The
  planner prices the same tail the simulated replicas run.

Writes benchmarks/results/simulate_cluster.json (--speculation: simulate_cluster_spec.json).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from patrl.lenpredict import (
    H100_SXM_NODE,
    LLAMA31_8B,
    QWEN3_14B,
    AdaptivePolicy,
    Decision,
    LatencyModel,
    Layout,
    LengthPredictor,
    LongTailSpec,
    ModelInfo,
    PlannerConfig,
    PredictorConfig,
    ReconfigPlanner,
    RolloutSimulator,
    RunningSet,
    SimConfig,
    SpeculativeTail,
    group_by_step,
    held_out_error,
    long_tail_trace,
    roofline_profile,
)
from patrl.lenpredict.calibration import fit_report
from patrl.lenpredict.roofline import VLLM_V0_ENGINE, NodeSpec
from patrl.lenpredict.simulate import UNCAPPED, PolicySpec, cost_sweep, run_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner_bench  # a sibling script, not a package

RESULTS = Path(__file__).parent / "results"
WORLD = 8
PROMPTS, SAMPLES, STEPS = 128, 8, 3
VERL_DEFAULT_TP = 2
SPEC = LongTailSpec()
CAPS: tuple[int | None, ...] = (256, 1024, None)  # None: the KV-memory limit


def cap_label(cap: int | None) -> str:
    return "KV-limited" if cap is None else str(cap)


def sim_config(assignment: str, cap: int | None = 256, memory: float = 0.9) -> SimConfig:
    return SimConfig(
        max_num_seqs=cap or UNCAPPED,
        max_num_batched_tokens=SPEC.max_length + 1024,
        memory_utilization=memory,
        plan_interval_steps=64,
        assignment=assignment,
        max_response_length=SPEC.max_length,
    )


def planner_config(cap: int | None, memory: float = 0.9, **extra: Any) -> PlannerConfig:
    return PlannerConfig(max_num_seqs=cap or UNCAPPED, memory_utilization=memory, **extra)


RUNS = [
    *((f"static:{tp}", "round_robin", "oracle", "quantiles") for tp in (1, 2, 4, 8)),
    *((f"static:{tp}", "lpt", "oracle", "quantiles") for tp in (1, 2, 4, 8)),
    ("adaptive", "lpt", "oracle", "quantiles"),
    ("adaptive", "lpt", "predicted", "quantiles"),
    ("adaptive", "lpt", "predicted", "independent"),
]


def simulate_model(model: ModelInfo, cap: int | None) -> list[dict[str, Any]]:
    latency = LatencyModel.fit(roofline_profile(model))
    steps = group_by_step(long_tail_trace(SPEC, PROMPTS, SAMPLES, steps=STEPS, seed=0))
    rows = []
    for name, assignment, knowledge, finish in RUNS:
        results = run_policy(
            PolicySpec.parse(name),
            steps,
            latency,
            WORLD,
            sim_config(assignment, cap),
            planner_config(cap, finish_time=finish),
            knowledge,  # type: ignore[arg-type]
        )
        rows.append(
            {
                "model": model.name,
                "cap": cap_label(cap),
                "policy": name,
                "assignment": assignment,
                "lengths": knowledge,
                "finish_time": finish,
                "per_step_s": [r.total_s for r in results],
                "total_s": sum(r.total_s for r in results),
                "switches": [[list(s) for s in r.switches] for r in results],
                "preemptions": sum(r.preemptions for r in results),
            }
        )
    return rows


def decompose(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The gain of adaptive over verl's default, split (in points of verl's time) into the
    better static TP, length-aware assignment and adaptive folds; and adaptive against every
    static layout."""

    def time_of(
        policy: str, assignment: str, lengths: str = "oracle", finish: str = "quantiles"
    ) -> float:
        return next(
            r["total_s"]
            for r in rows
            if (r["policy"], r["assignment"], r["lengths"], r["finish_time"])
            == (policy, assignment, lengths, finish)
        )

    rr = {tp: time_of(f"static:{tp}", "round_robin") for tp in (1, 2, 4, 8)}
    lpt = {tp: time_of(f"static:{tp}", "lpt") for tp in (1, 2, 4, 8)}
    verl = rr[VERL_DEFAULT_TP]
    best_rr_tp = min(rr, key=rr.__getitem__)
    best_lpt_tp = min(lpt, key=lpt.__getitem__)
    adaptive = time_of("adaptive", "lpt")
    predicted_q = time_of("adaptive", "lpt", "predicted", "quantiles")
    predicted_i = time_of("adaptive", "lpt", "predicted", "independent")
    return {
        "verl_default_s": verl,
        "best_static_rr": {"tp": best_rr_tp, "s": rr[best_rr_tp]},
        "best_static_lpt": {"tp": best_lpt_tp, "s": lpt[best_lpt_tp]},
        "adaptive_s": adaptive,
        "adaptive_vs_verl": adaptive / verl - 1,
        "parts_of_verl": {
            "better_static_choice": (verl - rr[best_rr_tp]) / verl,
            "length_aware_assignment": (rr[best_rr_tp] - lpt[best_lpt_tp]) / verl,
            "adaptive_folds": (lpt[best_lpt_tp] - adaptive) / verl,
        },
        "adaptive_vs_static_lpt": {tp: adaptive / t - 1 for tp, t in lpt.items()},
        "adaptive_vs_static_rr": {tp: adaptive / t - 1 for tp, t in rr.items()},
        "predicted_quantiles_vs_verl": predicted_q / verl - 1,
        "predicted_independent_vs_verl": predicted_i / verl - 1,
        "predicted_quantiles_vs_best_static": predicted_q / lpt[best_lpt_tp] - 1,
        "predicted_independent_vs_best_static": predicted_i / lpt[best_lpt_tp] - 1,
    }


def print_decomposition(table: dict[str, dict[str, dict[str, Any]]]) -> None:
    print(
        "\nSIMULATED generation time, 3 GRPO steps of 128x8 on 8xH100 (calibrated roofline), "
        "sum of steps; gain over verl's TP 2 (round-robin) split into its parts"
    )
    print(
        f"{'model':<13} {'cap':>10} {'verl_s':>7} {'best static':>12} {'adaptive_s':>10} "
        f"{'vs verl':>8} {'static':>7} {'assign':>7} {'folds':>7} {'pred(q)':>8} {'pred(i)':>8}"
    )
    for model, caps in table.items():
        for cap, d in caps.items():
            p = d["parts_of_verl"]
            best = f"TP{d['best_static_lpt']['tp']} {d['best_static_lpt']['s']:.0f}s"
            print(
                f"{model:<13} {cap:>10} {d['verl_default_s']:>7.1f} {best:>12} "
                f"{d['adaptive_s']:>10.1f} {100 * d['adaptive_vs_verl']:>+7.1f}% "
                f"{100 * p['better_static_choice']:>6.1f}p {100 * p['length_aware_assignment']:>6.1f}p "
                f"{100 * p['adaptive_folds']:>6.1f}p {100 * d['predicted_quantiles_vs_verl']:>+7.1f}% "
                f"{100 * d['predicted_independent_vs_verl']:>+7.1f}%"
            )
    print("adaptive (oracle lengths) against every static layout (LPT / round-robin):")
    for model, caps in table.items():
        for cap, d in caps.items():
            cells = "  ".join(
                f"TP{tp} {100 * d['adaptive_vs_static_lpt'][tp]:+.1f}%/{100 * d['adaptive_vs_static_rr'][tp]:+.1f}%"
                for tp in (1, 2, 4, 8)
            )
            print(f"  {model:<13} {cap:>10}  {cells}")


def lower_bounds(model: ModelInfo, cap: int) -> list[dict[str, float]]:
    """SIMULATED, per step: what no layout policy can beat under this latency model.

    - kv_read_s: every decode step reads the KV of every context token of its batch; a
      replica of tp GPUs pays c_tp per token, c_tp·tp GPU-seconds, the same at every TP
      (each rank reads its share of the heads), so the node's 8 GPUs need at least
      min_tp(c_tp·tp)·Σ context-steps / 8 seconds whatever the layout.
    - weights_s: every step reads the replica's weights (a_tp); at best every step runs
      `cap` sequences, so at least min_tp(a_tp·tp / cap)·tokens / 8.
    - tail_s: the longest sample alone on the fastest layout for batch 1.
    lower_bound_s = max(kv_read_s + weights_s, tail_s)."""
    latency = LatencyModel.fit(roofline_profile(model))
    tps = latency.tp_sizes
    per_token = min(latency.step_coefficients(tp).per_token * tp for tp in tps)
    fixed = min(latency.step_coefficients(tp).fixed * tp / cap for tp in tps)
    out = []
    for step, groups in group_by_step(
        long_tail_trace(SPEC, PROMPTS, SAMPLES, steps=STEPS, seed=0)
    ).items():
        prompt = np.array([g.prompt_tokens for g in groups for _ in g.response_tokens], float)
        length = np.array([n for g in groups for n in g.response_tokens], float)
        context_steps = float((length * (prompt + 1) + length * (length - 1) / 2).sum())
        kv = per_token * context_steps / WORLD
        weights = fixed * float(length.sum()) / WORLD
        longest = int(np.argmax(length))
        ctx = prompt[longest] + 1 + np.arange(int(length[longest]))
        tail = min(float(latency.step_time(tp, 1, ctx, ctx).sum()) for tp in tps)
        out.append(
            {
                "step": step,
                "kv_read_s": kv,
                "weights_s": weights,
                "tail_s": tail,
                "lower_bound_s": max(kv + weights, tail),
            }
        )
    return out


class ScriptedPlanner(ReconfigPlanner):
    """Switches to each TP of `schedule` once at most `count` sequences are unfinished (and
    the switch is admissible: no replica over max_num_seqs), whatever the predicted gain."""

    def __init__(
        self,
        latency: LatencyModel,
        schedule: list[tuple[int, int]],
        world: int = WORLD,
        config: PlannerConfig | None = None,
    ):
        config = (config or PlannerConfig()).model_copy(update={"margin": 1e9})
        super().__init__(latency, world, config)
        self.schedule = schedule
        self.next = 0

    def new_rollout(self) -> None:
        super().new_rollout()
        self.next = 0

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        priced = super().decide(running, current)  # the options, with their overheads
        self._direction, self._since_switch = 0, self.config.cooldown_calls
        if self.next < len(self.schedule) and len(running) <= self.schedule[self.next][0]:
            tp = self.schedule[self.next][1]
            option = next(o for o in priced.options if o.layout.tp == tp)
            if np.isfinite(option.overhead_s):
                self.next += 1
                return Decision(
                    "switch", current, option.layout, 0.0, option.overhead_s, "scripted",
                    priced.options, running.seq_ids,
                )  # fmt: skip
        return Decision(
            "stay", current, current, 0.0, 0.0, "scripted", priced.options, running.seq_ids
        )


def scripted_schedules(model: ModelInfo) -> dict[str, Any]:
    """SIMULATED, first step only, cap 256: the planner against every schedule of one or two
    growing switches from TP 1 or 2 at sequence counts of a grid (oracle lengths, LPT): is a
    better switching schedule there for the planner to find?"""
    latency = LatencyModel.fit(roofline_profile(model))
    groups = group_by_step(long_tail_trace(SPEC, PROMPTS, SAMPLES, steps=1, seed=0))[0]
    simulator = RolloutSimulator(latency, WORLD, sim_config("lpt", 256))
    counts = (768, 512, 256, 128, 32)
    tried = []
    for start in (1, 2):
        ups = [tp for tp in (2, 4, 8) if tp > start]
        paths: list[list[int]] = (
            [[]] + [[tp] for tp in ups] + [list(p) for p in itertools.combinations(ups, 2)]
        )
        for path in paths:
            for at in itertools.combinations(counts, len(path)):
                schedule = list(zip(at, path, strict=True))
                policy = AdaptivePolicy(
                    ScriptedPlanner(latency, schedule), Layout(WORLD // start, start)
                )
                tried.append((simulator.run(groups, policy).total_s, start, schedule))
    tried.sort(key=lambda t: t[0])
    planner = simulator.run(
        groups, AdaptivePolicy(ReconfigPlanner(latency, WORLD), Layout(WORLD, 1))
    )
    best_s, start, schedule = tried[0]
    return {
        "schedules_tried": len(tried),
        "best_scripted_s": best_s,
        "best_scripted": {"start_tp": start, "switch_at_count_to_tp": schedule},
        "planner_s": planner.total_s,
        "planner_switches": [list(s) for s in planner.switches],
    }


def sensitivity(model: ModelInfo) -> list[dict[str, Any]]:
    """SIMULATED, first step only, oracle lengths, caps 256 and 1024: how the reduction moves
    with the workload and with the calibration's weakest constants."""
    base = H100_SXM_NODE
    v0 = dataclasses.replace(base, engine=VLLM_V0_ENGINE)
    graph_ar = dataclasses.replace(
        base,
        link=dataclasses.replace(base.link, allreduce_latency_s=((2, 5.98e-6), (8, 8.0e-6))),
    )
    no_width = dataclasses.replace(base, gpu=dataclasses.replace(base.gpu, gemm_width_half=0.0))
    cases: list[tuple[str, LongTailSpec, int, NodeSpec, float]] = [
        ("headline: 128x8", SPEC, PROMPTS, base, 0.9),
        ("64 prompts x 8", SPEC, 64, base, 0.9),
        ("median length 1000", dataclasses.replace(SPEC, median=1000.0), PROMPTS, base, 0.9),
        ("cap 32768", dataclasses.replace(SPEC, max_length=32768), PROMPTS, base, 0.9),
        ("engine: vLLM 0.7.2 overheads (4.3 ms + 0.16 ms/seq)", SPEC, PROMPTS, v0, 0.9),
        ("TP-8 all-reduce 8 us (graph-mode guess)", SPEC, PROMPTS, graph_ar, 0.9),
        ("no TP width inefficiency (GEMM eff. as TP 1)", SPEC, PROMPTS, no_width, 0.9),
        # what colocated verl runs: the trainer keeps the rest of the GPU
        ("gpu_memory_utilization 0.5", SPEC, PROMPTS, base, 0.5),
        *((f"{r:.0%} of samples run to the cap (loops)", dataclasses.replace(SPEC, runaway_rate=r), PROMPTS, base, 0.9)
          for r in (0.01, 0.05)),
    ]  # fmt: skip
    out = []
    for label, spec, prompts, node, memory in cases:
        latency = LatencyModel.fit(roofline_profile(model, node, memory_utilization=memory))
        steps = {0: group_by_step(long_tail_trace(spec, prompts, SAMPLES, steps=1, seed=0))[0]}
        row: dict[str, Any] = {"case": label}
        for cap in (256, 1024):
            times = {}
            for name, assignment in [
                *((f"static:{tp}", "lpt") for tp in (1, 2, 4, 8)),
                (f"static:{VERL_DEFAULT_TP}", "round_robin"),
                ("adaptive", "lpt"),
            ]:
                config = sim_config(assignment, cap, memory).model_copy(
                    update={
                        "max_num_batched_tokens": spec.max_length + 1024,
                        "max_response_length": spec.max_length,
                    }
                )
                (result,) = run_policy(
                    PolicySpec.parse(name),
                    steps,
                    latency,
                    WORLD,
                    config,
                    planner_config(cap, memory),
                )
                times[f"{name} ({assignment})"] = result.total_s
            verl = times[f"static:{VERL_DEFAULT_TP} (round_robin)"]
            static = {k: t for k, t in times.items() if k.startswith("static") and "lpt" in k}
            best = min(static, key=static.__getitem__)
            adaptive = times["adaptive (lpt)"]
            row[str(cap)] = {
                "times_s": times,
                "best_static": best,
                "adaptive_vs_verl_default": adaptive / verl - 1,
                "adaptive_vs_best_static": adaptive / static[best] - 1,
            }
        out.append(row)
    return out


def sweep(model: ModelInfo) -> dict[str, Any]:
    """SIMULATED cost-aware scaling (RLHFless), first step, cap 256, oracle lengths: 1-16 H100s
    for the rollout; sweet spots with no idle GPUs and with one 8-GPU trainer node waiting."""
    latency = LatencyModel.fit(roofline_profile(model))
    steps = {0: group_by_step(long_tail_trace(SPEC, PROMPTS, SAMPLES, steps=1, seed=0))[0]}
    out = {}
    for idle in (0, 8):
        out[f"idle_{idle}"] = cost_sweep(
            [1, 2, 4, 8, 16], steps, latency, WORLD, sim_config("lpt", 256), planner_config(256),
            idle_gpus=idle,
        )  # fmt: skip
    return out


def print_sweep(model: str, result: dict[str, Any]) -> None:
    rows = result["idle_0"]["rows"]
    print(f"\nSIMULATED cost sweep, {model}, first step (128x8), cap 256: per step")
    print(
        f"{'gpus':>5} {'best static':>12} {'time_s':>7} {'GPU-h':>7} {'adaptive_s':>10} {'GPU-h':>7}"
    )
    for gpus in sorted({r["gpus"] for r in rows}):
        mine = [r for r in rows if r["gpus"] == gpus]
        static = min(
            (r for r in mine if r["policy"].startswith("static")), key=lambda r: r["time_s"]
        )
        adaptive = next((r for r in mine if r["policy"] == "adaptive"), None)
        a = (
            f"{adaptive['time_s']:>10.1f} {adaptive['gpu_hours']:>7.3f}"
            if adaptive
            else f"{'-':>10} {'-':>7}"
        )
        print(
            f"{gpus:>5} {static['policy']:>12} {static['time_s']:>7.1f} {static['gpu_hours']:>7.3f} {a}"
        )
    for idle in (0, 8):
        r = result[f"idle_{idle}"]
        for key, label in (("sweet_spot_static", "static"), ("sweet_spot", "with adaptive")):
            s = r[key]
            print(
                f"  sweet spot ({idle} idle GPUs, {label}): {s['gpus']} GPUs {s['policy']}, "
                f"{s['time_s']:.1f} s, {s['gpu_hours']:.3f} rollout GPU-h"
            )


def predictor_error() -> dict[str, Any]:
    """Remaining-length error of the LengthPredictor on the benchmark's trace, replayed with
    predictions at fixed lengths as samples progress: its own online report (every prediction,
    the cold first epoch included) and, from the second epoch on, MAE and quantile coverage."""
    predictor = LengthPredictor(PredictorConfig(max_length=SPEC.max_length))
    steps = group_by_step(long_tail_trace(SPEC, PROMPTS, SAMPLES, steps=STEPS, seed=0))
    later: list[tuple[float, bool, bool, bool]] = []
    for step, groups in steps.items():
        samples = []
        for g in groups:
            gid = f"{step}/{g.prompt_id}"
            predictor.start_group(gid, g.prompt_id, len(g.response_tokens))
            samples += [(n, gid, i) for i, n in enumerate(g.response_tokens)]
        samples.sort()
        done = 0
        for level in (0, 512, 2048, 8192):
            while done < len(samples) and samples[done][0] <= level:
                n, gid, i = samples[done]
                predictor.observe_finished(f"{gid}/{i}", gid, n)
                done += 1
            for n, gid, i in samples[done:]:
                q = predictor.predict_remaining(f"{gid}/{i}", gid, level)
                if step > 0:
                    truth = n - level
                    later.append((abs(truth - q[1]), truth <= q[0], truth <= q[1], truth <= q[2]))
        for n, gid, i in samples[done:]:
            predictor.observe_finished(f"{gid}/{i}", gid, n)
    scored = np.array(later, dtype=float)
    return {
        "online_report_all_epochs": predictor.error_report(),
        "from_second_epoch": {
            "predictions": len(later),
            "mae": float(scored[:, 0].mean()),
            "coverage": dict(
                zip(("0.1", "0.5", "0.9"), scored[:, 1:].mean(axis=0).tolist(), strict=True)
            ),
        },
    }


def decide_timing(calls: int = 100) -> dict[str, float]:
    """MEASURED on this machine: median wall microseconds of one `decide` over 256 sequences x
    3 quantiles, from dp8xtp1, under each finish-time pricing."""
    latency = LatencyModel.fit(roofline_profile(LLAMA31_8B))
    running = planner_bench.running_set(256)
    out = {}
    for finish in ("quantiles", "independent"):
        planner = ReconfigPlanner(
            latency, WORLD, PlannerConfig(max_num_seqs=1024, finish_time=finish)
        )
        wall = []
        for _ in range(calls):
            planner.new_rollout()
            start = time.perf_counter()
            planner.decide(running, Layout(WORLD, 1))
            wall.append(time.perf_counter() - start)
        out[finish] = statistics.median(wall) * 1e6
    return out


# tails MEASURED by spec_bench.py (benchmarks/README.md, "Speculative rollouts"): acceptance and
# tokens per sample step, second epoch
SPEC_RUNS = {
    "demo SFT T=1": (0.45, 1.19),
    "random Llama greedy": (0.78, 1.32),
}
SPEC_MAX_NUM_SEQS, SPEC_TOKENS = 16, 4  # rollout.speculative defaults


def speculation_tails() -> dict[str, SpeculativeTail | None]:
    tails: dict[str, SpeculativeTail | None] = {"no speculation": None}
    for name, (acceptance, tokens) in SPEC_RUNS.items():
        logged = {"rollout/spec_acceptance": acceptance, "rollout/spec_tokens_per_step": tokens}
        tails[f"{name}, as logged"] = SpeculativeTail.from_metrics([logged], SPEC_MAX_NUM_SEQS)
        tails[f"{name}, chain"] = SpeculativeTail.from_acceptance(
            acceptance, SPEC_TOKENS, SPEC_MAX_NUM_SEQS
        )
    return tails


def speculating_tail(model: ModelInfo, cap: int = 256) -> list[dict[str, Any]]:
    """SIMULATED: verl's default, every static layout (LPT) and adaptive (oracle and predicted
    lengths) for the 3 steps at `cap`, with each tail of `speculation_tails`."""
    latency = LatencyModel.fit(roofline_profile(model, query_lens=(2, 3, 5)))
    steps = group_by_step(long_tail_trace(SPEC, PROMPTS, SAMPLES, steps=STEPS, seed=0))
    runs = [
        (f"static:{VERL_DEFAULT_TP}", "round_robin", "oracle"),
        *((f"static:{tp}", "lpt", "oracle") for tp in (1, 2, 4, 8)),
        ("adaptive", "lpt", "oracle"),
        ("adaptive", "lpt", "predicted"),
    ]
    out = []
    for label, tail in speculation_tails().items():
        times: dict[str, float] = {}
        switches: dict[str, list[Any]] = {}
        for name, assignment, knowledge in runs:
            results = run_policy(
                PolicySpec.parse(name),
                steps,
                latency,
                WORLD,
                sim_config(assignment, cap),
                planner_config(cap),
                knowledge,  # type: ignore[arg-type]
                tail,
            )
            key = f"{name} ({assignment}, {knowledge})"
            times[key] = sum(r.total_s for r in results)
            switches[key] = [[list(x) for x in r.switches] for r in results]
        verl = times[f"static:{VERL_DEFAULT_TP} (round_robin, oracle)"]
        static = {k: t for k, t in times.items() if k.startswith("static") and "lpt" in k}
        best = min(static, key=static.__getitem__)
        adaptive = times["adaptive (lpt, oracle)"]
        out.append(
            {
                "model": model.name,
                "cap": cap,
                "tail": label,
                "speculation": None if tail is None else tail.record(),
                "times_s": times,
                "switches": switches,
                "best_static": best,
                "adaptive_vs_verl": adaptive / verl - 1,
                "adaptive_vs_best_static": adaptive / static[best] - 1,
                "predicted_vs_verl": times["adaptive (lpt, predicted)"] / verl - 1,
            }
        )
    base = {(r["model"]): r["times_s"] for r in out if r["speculation"] is None}
    for r in out:
        r["vs_no_speculation"] = {k: t / base[r["model"]][k] - 1 for k, t in r["times_s"].items()}
    return out


def print_speculation(rows: list[dict[str, Any]]) -> None:
    print(
        "\nSIMULATED speculating tail, 3 GRPO steps of 128x8 on 8xH100, cap 256, acceptance "
        "MEASURED by spec_bench.py on a CPU (see the module docstring)"
    )
    print(
        f"{'model':<13} {'tail':<30} {'tok/step':>8} {'verl_s':>7} {'best static':>12} "
        f"{'adaptive_s':>10} {'vs verl':>8} {'vs best':>8} {'pred vs verl':>12} "
        f"{'verl vs no-spec':>15} {'adaptive vs no-spec':>19}"
    )
    verl_key = f"static:{VERL_DEFAULT_TP} (round_robin, oracle)"
    for r in rows:
        t = r["times_s"]
        tokens = "-" if r["speculation"] is None else f"{r['speculation']['tokens_per_step']:.2f}"
        best = f"TP{r['best_static'].split(':')[1].split()[0]} {t[r['best_static']]:.0f}s"
        print(
            f"{r['model']:<13} {r['tail']:<30} {tokens:>8} {t[verl_key]:>7.1f} {best:>12} "
            f"{t['adaptive (lpt, oracle)']:>10.1f} {100 * r['adaptive_vs_verl']:>+7.1f}% "
            f"{100 * r['adaptive_vs_best_static']:>+7.1f}% {100 * r['predicted_vs_verl']:>+11.1f}% "
            f"{100 * r['vs_no_speculation'][verl_key]:>+14.1f}% "
            f"{100 * r['vs_no_speculation']['adaptive (lpt, oracle)']:>+18.1f}%"
        )


def speculation_main() -> None:
    started = time.perf_counter()
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = [r for m in (LLAMA31_8B, QWEN3_14B) for r in speculating_tail(m)]
    print_speculation(rows)
    payload = {
        "label": "SIMULATED (calibrated roofline 8xH100 profile with verify rows, synthetic "
        "DeepScaleR-like lengths); acceptance MEASURED by benchmarks/spec_bench.py on a CPU",
        "measured_tails": {
            k: {"acceptance": a, "tokens_per_step": t} for k, (a, t) in SPEC_RUNS.items()
        },
        "rows": rows,
        "machine": platform.platform(),
        "wall_s": time.perf_counter() - started,
    }
    (RESULTS / "simulate_cluster_spec.json").write_text(json.dumps(payload, indent=1))
    print(
        f"\nwrote {RESULTS / 'simulate_cluster_spec.json'} in {time.perf_counter() - started:.0f} s"
    )


def main() -> None:
    started = time.perf_counter()
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for model in (LLAMA31_8B, QWEN3_14B):
        table[model.name] = {}
        for cap in CAPS:
            model_rows = simulate_model(model, cap)
            rows += model_rows
            table[model.name][cap_label(cap)] = decompose(model_rows)
    print_decomposition(table)
    print(
        "\nfinish-time pricing, predicted lengths: adaptive's switches per step (time s, from, to)"
    )
    for r in rows:
        if r["lengths"] == "predicted":
            print(
                f"  {r['model']:<13} cap {r['cap']:>10} {r['finish_time']:<11} total "
                f"{r['total_s']:.1f} s  {[[(round(t, 1), a, b) for t, a, b in s] for s in r['switches']]}"
            )
    bounds = {m.name: lower_bounds(m, 256) for m in (LLAMA31_8B, QWEN3_14B)}
    print("\nSIMULATED lower bounds, cap 256, sum of steps (see lower_bounds):")
    for name, per_step in bounds.items():
        total = {k: sum(s[k] for s in per_step) for k in per_step[0] if k != "step"}
        print(
            f"  {name:<13} kv_read {total['kv_read_s']:.1f} s, weights {total['weights_s']:.1f} s, "
            f"tail {total['tail_s']:.1f} s, bound {total['lower_bound_s']:.1f} s against verl "
            f"{table[name]['256']['verl_default_s']:.1f} s"
        )
    scripted = {m.name: scripted_schedules(m) for m in (LLAMA31_8B, QWEN3_14B)}
    print("\nSIMULATED first step, cap 256: the planner against the best of the scripted schedules")
    for name, result in scripted.items():
        print(
            f"  {name}: planner {result['planner_s']:.1f} s; best of "
            f"{result['schedules_tried']} scripted schedules {result['best_scripted_s']:.1f} s "
            f"({result['best_scripted']})"
        )
    sensitive = sensitivity(LLAMA31_8B)
    print(
        "\nSIMULATED sensitivity, Llama-3.1-8B, first step, oracle lengths: adaptive vs verl default / vs best static"
    )
    for case in sensitive:
        cells = "   ".join(
            f"cap {cap}: {100 * case[cap]['adaptive_vs_verl_default']:+6.1f}% / "
            f"{100 * case[cap]['adaptive_vs_best_static']:+5.1f}% ({case[cap]['best_static'].split()[0]})"
            for cap in ("256", "1024")
        )
        print(f"  {case['case']:<52} {cells}")
    sweeps = {m.name: sweep(m) for m in (LLAMA31_8B, QWEN3_14B)}
    for name, result in sweeps.items():
        print_sweep(name, result)
    timing = decide_timing()
    print(
        f"\nMEASURED on this machine ({platform.machine()}): ReconfigPlanner.decide, 256 seqs x 3 "
        f"quantiles, median wall: quantiles {timing['quantiles']:.0f} us, independent (16 draws) "
        f"{timing['independent']:.0f} us"
    )
    error = predictor_error()
    print(
        f"LengthPredictor online remaining-length error on this trace: {error['from_second_epoch']}"
    )
    fits = {m.name: held_out_error(roofline_profile(m)) for m in (LLAMA31_8B, QWEN3_14B)}
    print(f"latency-model held-out MAPE per tp on the calibrated profile: {fits}")
    speculation = [r for m in (LLAMA31_8B, QWEN3_14B) for r in speculating_tail(m)]
    print_speculation(speculation)
    calibration = fit_report()
    worst = max(abs(r["error"]) for r in calibration)
    print(
        f"calibration: {len(calibration)} cited points, worst |model/measured - 1| {100 * worst:.1f}%"
    )
    payload = {
        "label": "SIMULATED (calibrated roofline 8xH100 profile, synthetic DeepScaleR-like lengths); planner timing MEASURED",
        "setting": {
            "world": WORLD,
            "prompts": PROMPTS,
            "samples": SAMPLES,
            "steps": STEPS,
            "length_spec": repr(SPEC),
            "caps": [cap_label(c) for c in CAPS],
            "verl_default_tp": VERL_DEFAULT_TP,
        },
        "rows": rows,
        "decomposition": table,
        "lower_bounds": bounds,
        "scripted_schedules": scripted,
        "sensitivity": sensitive,
        "cost_sweep": sweeps,
        "speculating_tail": speculation,
        "planner_decide_us": timing,
        "predictor_error": error,
        "latency_model_held_out_mape": {
            m: {str(k): v for k, v in f.items()} for m, f in fits.items()
        },
        "calibration_worst_error": worst,
        "machine": platform.platform(),
        "wall_s": time.perf_counter() - started,
    }
    (RESULTS / "simulate_cluster.json").write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {RESULTS / 'simulate_cluster.json'} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    speculation_main() if "--speculation" in sys.argv[1:] else main()
