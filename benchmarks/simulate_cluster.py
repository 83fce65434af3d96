"""SIMULATED: adaptive TP vs static TP for GRPO rollouts on one 8xH100 node (the PAT setting).

Everything this script reports about generation time is a simulation: a roofline latency model
of an 8xH100 SXM5 NVLink node (patrl.lenpredict.roofline, every constant sourced there), the
rollout simulator (continuous batching, max_num_seqs=256, KV budget at 90% of HBM), and a
synthetic DeepScaleR-like length distribution. Only the planner call latency is measured, on
the machine running the script.

Setting
- Models: Llama-3.1-8B and Qwen3-14B in bfloat16, 8 GPUs, TP in {1, 2, 4, 8}.
- Batch: 128 prompts x 8 samples (GRPO), 3 steps over the same 128 prompts (prompts recur
  across epochs, which is what the length predictor learns from).
- Lengths: LongTailSpec() of patrl.lenpredict.length_trace, stated exactly there: per prompt a
  log-normal scale (median 2000 tokens, sigma 0.5) and a failure rate U(0, 0.6); failed
  samples 3x longer (DeepScaleR's authors report wrong answers ~3x longer than right ones);
  per-sample log-normal noise (sigma 0.4); capped at max_response_length=16384 (DeepScaleR's
  16K stage). Why: DeepScaleR reports mean response lengths of ~3.5-5.5K tokens in its 8K
  stage and moves to 16K/24K contexts because long, often wrong answers get truncated: a long
  tail of a few samples near the cap is the regime PAT targets.
- verl default: actor_rollout_ref.rollout.tensor_model_parallel_size=2 (verl's
  ppo_trainer.yaml), prompts split evenly across replicas (round-robin here).
- Concurrency: max_num_seqs=256 per replica (RLBoost's verl+vLLM artifact); a second table
  uses verl's own rollout default, max_num_seqs=1024.
- Policies: static TP with round-robin assignment (what verl does), static TP with the
  length-aware LPT assignment, adaptive (LPT + the ReconfigPlanner, starting from TP 1) with
  oracle lengths and with the online LengthPredictor (trained only on earlier steps).

Writes benchmarks/results/simulate_cluster.json and, if matplotlib imports,
benchmarks/results/simulate_cluster_timeline.png.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import platform
import sys
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
    SimResult,
    group_by_step,
    held_out_error,
    long_tail_trace,
    roofline_profile,
)
from patrl.lenpredict.simulate import PolicySpec, run_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner_bench  # a sibling script, not a package

RESULTS = Path(__file__).parent / "results"
WORLD = 8
PROMPTS, SAMPLES, STEPS = 128, 8, 3
VERL_DEFAULT_TP = 2
SPEC = LongTailSpec()


def sim_config(assignment: str, max_num_seqs: int = 256) -> SimConfig:
    return SimConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=SPEC.max_length + 1024,
        memory_utilization=0.9,
        plan_interval_steps=64,
        assignment=assignment,
    )


def simulate_model(
    model: ModelInfo, max_num_seqs: int = 256
) -> tuple[list[dict[str, Any]], dict[str, SimResult]]:
    profile = roofline_profile(model)
    latency = LatencyModel.fit(profile)
    steps = group_by_step(long_tail_trace(SPEC, PROMPTS, SAMPLES, steps=STEPS, seed=0))
    planner_config = PlannerConfig(max_num_seqs=max_num_seqs)
    runs = [(f"static:{tp}", "round_robin", "oracle") for tp in (1, 2, 4, 8)]
    if max_num_seqs == 256:
        runs += [(f"static:{tp}", "lpt", "oracle") for tp in (1, 2, 4, 8)]
        runs += [("adaptive", "lpt", "oracle"), ("adaptive", "lpt", "predicted")]
    runs += [("adaptive", "round_robin", "oracle")]
    rows, first_step = [], {}
    for name, assignment, knowledge in runs:
        results = run_policy(
            PolicySpec.parse(name),
            steps,
            latency,
            WORLD,
            sim_config(assignment, max_num_seqs),
            planner_config,
            knowledge,  # type: ignore[arg-type]
        )
        label = f"{name} ({assignment}, {knowledge})"
        first_step[label] = results[0]
        rows.append(
            {
                "model": model.name,
                "max_num_seqs": max_num_seqs,
                "policy": name,
                "assignment": assignment,
                "lengths": knowledge,
                "per_step_s": [r.total_s for r in results],
                "total_s": sum(r.total_s for r in results),
                "switches": [[list(s) for s in r.switches] for r in results],
                "preemptions": sum(r.preemptions for r in results),
            }
        )
    return rows, first_step


def lower_bounds(model: ModelInfo, max_num_seqs: int = 256) -> list[dict[str, float]]:
    """SIMULATED, per step: what no layout policy can beat under this latency model.

    - kv_read_s: every decode step reads the KV of every context token of its batch; a
      replica of tp GPUs pays c_tp per token, c_tp·tp GPU-seconds, the same at every TP
      (each rank reads its share of the heads), so the node's 8 GPUs need at least
      min_tp(c_tp·tp)·Σ context-steps / 8 seconds whatever the layout.
    - weights_s: every step reads the replica's weights (a_tp); at best every step runs
      max_num_seqs sequences, so at least min_tp(a_tp·tp / max_num_seqs)·tokens / 8.
    - tail_s: the longest sample alone on the fastest layout for batch 1 (TP 8).
    lower_bound_s = max(kv_read_s + weights_s, tail_s)."""
    latency = LatencyModel.fit(roofline_profile(model))
    tps = latency.tp_sizes
    per_token = min(latency.step_coefficients(tp).per_token * tp for tp in tps)
    fixed = min(latency.step_coefficients(tp).fixed * tp / max_num_seqs for tp in tps)
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
    """SIMULATED, first step only: the planner against every schedule of one or two growing
    switches from TP 1 or 2 at sequence counts of a grid (oracle lengths, LPT): is a
    better switching schedule there for the planner to find?"""
    latency = LatencyModel.fit(roofline_profile(model))
    groups = group_by_step(long_tail_trace(SPEC, PROMPTS, SAMPLES, steps=1, seed=0))[0]
    simulator = RolloutSimulator(latency, WORLD, sim_config("lpt"))
    counts = (768, 512, 256, 128, 32)
    tried = []
    for start in (1, 2):
        ups = [tp for tp in (2, 4, 8) if tp > start]
        paths = [[]] + [[tp] for tp in ups] + [list(p) for p in itertools.combinations(ups, 2)]
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
    """SIMULATED, first step only, oracle lengths: how the reduction moves with the workload
    and with the roofline's ASSUMPTION constants. Not the headline setting; it shows which
    regime a >= 30% reduction needs."""
    base = H100_SXM_NODE
    slow_tp = dataclasses.replace(
        base, collective_latency_s=((2, 18e-6), (4, 24e-6), (8, 30e-6)), step_overhead_s=2e-3
    )
    runaway = [
        (f"{rate:.0%} of samples run to the cap (repetition loops)", rate)
        for rate in (0.01, 0.02, 0.05)
    ]
    cases = [
        ("headline: 128x8", SPEC, PROMPTS, base, 0.9),
        ("64 prompts x 8", SPEC, 64, base, 0.9),
        ("32 prompts x 8", SPEC, 32, base, 0.9),
        ("median length 1000", dataclasses.replace(SPEC, median=1000.0), PROMPTS, base, 0.9),
        ("cap 32768", dataclasses.replace(SPEC, max_length=32768), PROMPTS, base, 0.9),
        ("3x collective latency, 2 ms step overhead", SPEC, PROMPTS, slow_tp, 0.9),
        # what colocated verl runs: the trainer keeps the rest of the GPU (ppo_trainer.yaml
        # 0.5; RLBoost's verl artifact 0.6)
        ("gpu_memory_utilization 0.6", SPEC, PROMPTS, base, 0.6),
        ("gpu_memory_utilization 0.5", SPEC, PROMPTS, base, 0.5),
        *((label, dataclasses.replace(SPEC, runaway_rate=r), PROMPTS, base, 0.9)
          for label, r in runaway),
    ]  # fmt: skip
    out = []
    for label, spec, prompts, node, memory in cases:
        latency = LatencyModel.fit(roofline_profile(model, node, memory_utilization=memory))
        steps = {0: group_by_step(long_tail_trace(spec, prompts, SAMPLES, steps=1, seed=0))[0]}
        times = {}
        for name, assignment in [
            *((f"static:{tp}", "lpt") for tp in (1, 2, 4, 8)),
            (f"static:{VERL_DEFAULT_TP}", "round_robin"),
            ("adaptive", "lpt"),
        ]:
            config = sim_config(assignment).model_copy(
                update={
                    "max_num_batched_tokens": spec.max_length + 1024,
                    "memory_utilization": memory,
                }
            )
            (result,) = run_policy(
                PolicySpec.parse(name),
                steps,
                latency,
                WORLD,
                config,
                PlannerConfig(memory_utilization=memory),
            )
            times[f"{name} ({assignment})"] = result.total_s
        verl = times[f"static:{VERL_DEFAULT_TP} (round_robin)"]
        best = min(t for k, t in times.items() if k.startswith("static"))
        adaptive = times["adaptive (lpt)"]
        out.append(
            {
                "case": label,
                "times_s": times,
                "adaptive_vs_verl_default": adaptive / verl - 1,
                "adaptive_vs_best_static": adaptive / best - 1,
            }
        )
    return out


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


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        statics = {
            (r["policy"], r["assignment"]): r["total_s"]
            for r in mine
            if r["policy"].startswith("static")
        }
        best_static = min(statics.values())
        verl = statics[(f"static:{VERL_DEFAULT_TP}", "round_robin")]
        for r in mine:
            r["vs_best_static"] = r["total_s"] / best_static - 1
            r["vs_verl_default"] = r["total_s"] / verl - 1
        out.append(
            {
                "model": model,
                "max_num_seqs": mine[0]["max_num_seqs"],
                "best_static_s": best_static,
                "verl_default_s": verl,
            }
        )
    return out


def print_table(rows: list[dict[str, Any]], setting: str) -> None:
    print(
        "\nSIMULATED generation latency, 3 GRPO steps of 128x8 on 8xH100 (roofline), sum of "
        f"steps; {setting}"
    )
    header = f"{'model':<14} {'policy':<10} {'assign':<12} {'lengths':<10} {'time_s':>8} {'vs_verl_tp2':>12} {'vs_best_static':>15}"
    print(header)
    for r in rows:
        print(
            f"{r['model']:<14} {r['policy']:<10} {r['assignment']:<12} {r['lengths']:<10} "
            f"{r['total_s']:>8.1f} {100 * r['vs_verl_default']:>+11.1f}% {100 * r['vs_best_static']:>+14.1f}%"
        )


def print_bounds(rows: list[dict[str, Any]], bounds: dict[str, list[dict[str, float]]]) -> None:
    """Where the time goes: what no layout can remove against what the policies took."""
    print(
        "\nSIMULATED lower bounds per model, sum of steps (see lower_bounds): KV reads cost the "
        "same at every TP"
    )
    print(
        f"{'model':<14} {'kv_read':>8} {'weights':>8} {'tail':>6} {'bound':>7} {'verl':>7} "
        f"{'adaptive':>9} {'bound vs verl':>14} {'kv share of verl':>17}"
    )
    for model, steps in bounds.items():
        total = {k: sum(s[k] for s in steps) for k in steps[0] if k != "step"}
        mine = [r for r in rows if r["model"] == model and r["max_num_seqs"] == 256]
        verl = next(
            r["total_s"]
            for r in mine
            if r["policy"] == f"static:{VERL_DEFAULT_TP}" and r["assignment"] == "round_robin"
        )
        adaptive = next(
            r["total_s"]
            for r in mine
            if r["policy"] == "adaptive" and r["assignment"] == "lpt" and r["lengths"] == "oracle"
        )
        print(
            f"{model:<14} {total['kv_read_s']:>8.1f} {total['weights_s']:>8.1f} "
            f"{total['tail_s']:>6.1f} {total['lower_bound_s']:>7.1f} {verl:>7.1f} "
            f"{adaptive:>9.1f} {100 * (total['lower_bound_s'] / verl - 1):>+13.1f}% "
            f"{100 * total['kv_read_s'] / verl:>16.1f}%"
        )


def plot_timeline(first_steps: dict[str, dict[str, SimResult]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    chosen = ["static:2 (round_robin, oracle)", "static:4 (lpt, oracle)", "adaptive (lpt, oracle)"]
    models = list(first_steps)
    fig, axes = plt.subplots(
        len(chosen), len(models), figsize=(7 * len(models), 8), sharex="col", squeeze=False
    )
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green", 8: "tab:red"}
    for col, model in enumerate(models):
        for row, label in enumerate(chosen):
            ax = axes[row][col]
            result = first_steps[model][label]
            for seg in result.segments:
                if seg.kind == "switch":
                    ax.axvspan(seg.start_s, seg.end_s, color="black", alpha=0.3)
                    continue
                tp = Layout.parse(seg.layout).tp
                ax.plot([seg.start_s, seg.end_s], [seg.batch, seg.batch], color=colors[tp], lw=1)
            for t, _, to in result.switches:
                ax.axvline(t, color="black", ls="--", lw=0.8)
                ax.text(t, ax.get_ylim()[1] * 0.9, f" ->{to}", fontsize=7)
            ax.set_title(f"SIMULATED {model}: {label}, {result.total_s:.1f}s", fontsize=9)
            ax.set_ylabel("running seqs per replica")
        axes[-1][col].set_xlabel("time (s)")
    handles = [plt.Line2D([], [], color=c, label=f"TP {tp}") for tp, c in colors.items()]
    fig.legend(handles=handles, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    first_steps: dict[str, dict[str, SimResult]] = {}
    fits = {}
    for model in (LLAMA31_8B, QWEN3_14B):
        model_rows, first_steps[model.name] = simulate_model(model)
        rows += model_rows
        fits[model.name] = held_out_error(roofline_profile(model))
    # sensitivity: verl's own rollout default admits 1024 sequences per engine
    wide = [r for m in (LLAMA31_8B, QWEN3_14B) for r in simulate_model(m, max_num_seqs=1024)[0]]
    summary = summarise(rows) + summarise(wide)
    print_table(rows, "max_num_seqs=256 per replica (RLBoost's verl+vLLM artifact)")
    print_table(wide, "max_num_seqs=1024 per replica (verl ppo_trainer.yaml rollout default)")
    rows += wide
    bounds = {m.name: lower_bounds(m) for m in (LLAMA31_8B, QWEN3_14B)}
    print_bounds(rows, bounds)
    scripted = {m.name: scripted_schedules(m) for m in (LLAMA31_8B, QWEN3_14B)}
    print("\nSIMULATED first step: the planner against the best of the scripted schedules")
    for name, result in scripted.items():
        print(
            f"  {name}: planner {result['planner_s']:.1f} s; best of "
            f"{result['schedules_tried']} scripted schedules {result['best_scripted_s']:.1f} s "
            f"({result['best_scripted']})"
        )
    sensitive = sensitivity(LLAMA31_8B)
    print("\nSIMULATED sensitivity, Llama-3.1-8B, first step, oracle lengths")
    for case in sensitive:
        print(
            f"  {case['case']:<42} adaptive vs verl default "
            f"{100 * case['adaptive_vs_verl_default']:+6.1f}%, vs best static "
            f"{100 * case['adaptive_vs_best_static']:+6.1f}%"
        )
    timing = planner_bench.measure(repeats=3, calls=200, sizes=(256,))
    print(
        f"\nMEASURED on this machine ({platform.machine()}, load average "
        f"{timing['loadavg_before'][0]:.1f}): ReconfigPlanner.decide, 256 seqs x 3 quantiles "
        "(benchmarks/planner_bench.py)"
    )
    for case, (t,) in timing["cases"].items():
        print(
            f"  {case:<7} ({t['action']}): median wall {t['wall_us']:.0f} us, thread cpu "
            f"{t['cpu_us']:.0f} us (per-repeat wall medians: "
            f"{', '.join(f'{m:.0f}' for m in t['wall_us_per_repeat'])})"
        )
    error = predictor_error()
    print(f"LengthPredictor online remaining-length error on this trace: {error}")
    print(f"roofline latency-model held-out MAPE per tp: {fits}")
    png = RESULTS / "simulate_cluster_timeline.png"
    plotted = plot_timeline(first_steps, png)
    payload = {
        "label": "SIMULATED (roofline 8xH100 profile, synthetic DeepScaleR-like lengths); planner timing MEASURED",
        "setting": {
            "world": WORLD,
            "prompts": PROMPTS,
            "samples": SAMPLES,
            "steps": STEPS,
            "length_spec": SPEC.__repr__(),
            "sim_config": sim_config("lpt").model_dump(),
            "verl_default_tp": VERL_DEFAULT_TP,
        },
        "rows": rows,
        "summary": summary,
        "lower_bounds": bounds,
        "scripted_schedules": scripted,
        "sensitivity": sensitive,
        "planner_decide_us": timing,
        "predictor_error": error,
        "latency_model_held_out_mape": {
            m: {str(k): v for k, v in f.items()} for m, f in fits.items()
        },
        "machine": platform.platform(),
    }
    (RESULTS / "simulate_cluster.json").write_text(json.dumps(payload, indent=1))
    print(
        f"\nwrote {RESULTS / 'simulate_cluster.json'}"
        + (f" and {png}" if plotted else " (no matplotlib: no PNG)")
    )


if __name__ == "__main__":
    main()
