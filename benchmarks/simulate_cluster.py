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

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from patrl.lenpredict import (
    LLAMA31_8B,
    QWEN3_14B,
    DecodeRow,
    HardwareInfo,
    LatencyModel,
    Layout,
    LengthPredictor,
    LongTailSpec,
    ModelInfo,
    PlannerConfig,
    PredictorConfig,
    PrefillRow,
    Profile,
    ReconfigPlanner,
    RunningSet,
    SimConfig,
    SimResult,
    group_by_step,
    held_out_error,
    long_tail_trace,
    roofline_profile,
)
from patrl.lenpredict.simulate import PolicySpec, run_policy

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


def planner_latency_us(model: ModelInfo, repeats: int = 5, calls: int = 200) -> dict[str, Any]:
    """Measured: ReconfigPlanner.decide for 256 running sequences x 3 quantiles from dp8xtp1
    (three candidate targets, the most work), wall and process-CPU time. Two cases: a call
    that stays (the common one) and one whose best switch clears the margin, which also prices
    delaying it. Medians of `calls` calls, `repeats` times."""
    latency = LatencyModel.fit(roofline_profile(model))
    rng = np.random.default_rng(0)
    n = 256
    running = RunningSet(
        seq_ids=np.arange(n),
        replica=rng.integers(0, 8, n),
        context=rng.integers(200, 8000, n),
        remaining=np.sort(rng.lognormal(7, 1, (n, 3)), axis=1),
    )
    result: dict[str, Any] = {"sequences": n, "loadavg_before": os.getloadavg()}
    for case, margin in (("stay", 1e9), ("switch", 0.2)):
        planner = ReconfigPlanner(latency, WORLD, PlannerConfig(margin=margin))
        wall, cpu = [], []
        for _ in range(repeats):
            w, c = [], []
            for _ in range(calls):
                planner.new_rollout()
                w0, c0 = time.perf_counter(), time.process_time()
                planner.decide(running, Layout(8, 1))
                c.append(time.process_time() - c0)
                w.append(time.perf_counter() - w0)
            planner.decisions.clear()
            wall.append(statistics.median(w) * 1e6)
            cpu.append(statistics.median(c) * 1e6)
        planner.new_rollout()
        assert planner.decide(running, Layout(8, 1)).action == case
        result[case] = {
            "wall_us_per_repeat": wall,
            "cpu_us_per_repeat": cpu,
            "wall_us": statistics.median(wall),
            "cpu_us": statistics.median(cpu),
        }
    result["loadavg_after"] = os.getloadavg()
    return result


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


def measured_cpu_fit(seeds: int = 5) -> dict[str, Any] | None:
    """MEASURED on this machine: decode-step rows of a tiny random Llama (torch, one process,
    1 thread, TP 1, HF KV cache; per row the median over 3 passes of the median of 7 steps),
    then the LatencyModel's held-out
    error on them. The engine's profiler (patrl.rollout.profile) does not exist yet; this only
    checks that the fitted form holds on real, noisy CPU timings."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(config).eval()
    grid = [(b, c) for b in (1, 2, 4, 8, 16, 32) for c in (32, 128, 256, 512, 1024)]
    samples: dict[tuple[int, int], list[float]] = {cell: [] for cell in grid}
    prefill_samples: dict[int, list[float]] = {c: [] for _, c in grid}
    with torch.no_grad():
        # three passes over the grid, so a burst of load from other processes hits one sample
        # of a row rather than all of them; each sample is the median of 7 steps
        for _ in range(3):
            for batch, context in grid:
                ids = torch.randint(0, 1000, (batch, context))
                start = time.perf_counter()
                out = model(ids, use_cache=True)
                if batch == 1:
                    prefill_samples[context].append(time.perf_counter() - start)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                steps = []
                for _ in range(7):
                    start = time.perf_counter()
                    out = model(token, past_key_values=cache, use_cache=True)
                    steps.append(time.perf_counter() - start)
                    token = out.logits[:, -1:].argmax(-1)
                samples[(batch, context)].append(statistics.median(steps))
    decode = [
        DecodeRow(tp=1, batch=b, context_tokens=b * c, seconds=statistics.median(samples[(b, c)]))
        for b, c in grid
    ]
    prefill = [
        PrefillRow(tp=1, tokens=c, seconds=statistics.median(t)) for c, t in prefill_samples.items()
    ]
    info = ModelInfo(
        name="tiny-llama (random)",
        num_layers=4,
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=1000,
        num_params=sum(p.numel() for p in model.parameters()),
    )
    profile = Profile(
        source="measured",
        hardware=HardwareInfo(
            name=platform.node() or "this machine",
            device=platform.processor() or platform.machine(),
            num_devices=1,
            memory_bytes_per_device=2**34,
            interconnect="none",
        ),
        model=info,
        dtype="float32",
        decode=decode,
        prefill=prefill,
    )
    held_out = [held_out_error(profile, fraction=0.25, seed=seed)[1] for seed in range(seeds)]
    return {
        "rows": len(decode),
        "held_out_mape_per_seed": held_out,
        "held_out_mape_median": statistics.median(held_out),
        "fit": {str(k): v for k, v in LatencyModel.fit(profile).describe().items()},
        "loadavg": os.getloadavg(),
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
    timing = planner_latency_us(LLAMA31_8B)
    print(
        f"\nMEASURED on this machine ({platform.machine()}, load average {timing['loadavg_before']}):"
    )
    for case in ("stay", "switch"):
        t = timing[case]
        print(
            f"  ReconfigPlanner.decide, 256 seqs x 3 quantiles, {case} call: median wall "
            f"{t['wall_us']:.0f} us, cpu {t['cpu_us']:.0f} us (per-repeat wall medians: "
            f"{', '.join(f'{m:.0f}' for m in t['wall_us_per_repeat'])})"
        )
    cpu_fit = measured_cpu_fit()
    if cpu_fit is not None:
        print(
            f"LatencyModel held-out MAPE on {cpu_fit['rows']} decode rows MEASURED here (tiny Llama, "
            f"torch, TP 1, load average {cpu_fit['loadavg']}): median {cpu_fit['held_out_mape_median']:.3f} "
            f"over 5 random 25% hold-outs {[round(x, 3) for x in cpu_fit['held_out_mape_per_seed']]}"
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
        "planner_decide_us": timing,
        "predictor_error": error,
        "latency_model_measured_cpu": cpu_fit,
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
