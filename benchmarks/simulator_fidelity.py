"""Simulated vs measured total generation time on this machine (static layouts), and the
profiler's cost and latency-model error here.

    python benchmarks/simulator_fidelity.py [--repeats 5] [--requests 24]

MEASURED and SIMULATED side by side: a tiny random Llama (2 layers, hidden 64, fp32, CPU,
1 torch thread) generates 24 requests of long-tailed forced lengths (lognormal, median ~24,
up to 240 tokens) with continuous batching (max_num_seqs 8); the RolloutSimulator is fed the
run's lengths and a profile of this machine measured just before by patrl.rollout.profile.
DP=1 is one engine; DP=2 is two independent engines run one after the other (the measured
total is the slower one). Each repeat profiles, runs and simulates in turn, so load drifts on
this shared machine hit both sides alike; the tables report medians over repeats of the
simulated/measured ratio, per clock (wall: what a rollout waits; cpu: this thread's CPU time,
which other processes' load moves less). The schedules (prefill count and every decode step's
batch) are also compared; they must be identical.

Skewed batches. The engine's sdpa decode gathers every sequence's KV padded to the longest
one, so a step costs batch x longest context, not the total; the profiler's rows all hold
equal lengths, where the two are the same number. `skewed_rows` measures decode steps of one
long sequence beside short ones on the same engine, and the table reports the latency model's
error on them when fitted without them (the profiler's rows: total context), without them but
told that the backend pads (`LatencyModel.fit(profile, context_form="padded")`), and with them
(2-fold: each half predicted by a fit on the profile and the other half); and the simulated
total time again with every skewed row added to the profile ("sim/meas padded").

Writes benchmarks/results/simulator_fidelity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# the test module holds the experiment; this reruns it with timing
from test_simulator_fidelity import (
    TOLERANCE,
    build_model,
    engine_config,
    fidelity_grid,
    long_tail_groups,
    measure,
    measured_total,
    sim_config,
    simulated_steps,
)

from patrl.lenpredict import (
    DecodeRow,
    LatencyModel,
    Layout,
    Profile,
    RolloutSimulator,
    StaticPolicy,
    held_out_error,
)
from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl.rollout.profile import CLOCKS, ProfileGrid, profile_engine_config, timed_steps

RESULTS = Path(__file__).resolve().parent / "results"


SKEWED_CELLS = [(b, 16, long) for b in (2, 4, 8) for long in (96, 200, 300)]


def measure_skewed(
    engine: Engine, batch: int, short: int, long: int, steps: int, seed: int, clock: str
) -> float:
    """Median seconds of a decode step of one `long`-token sequence beside batch - 1 of
    `short` tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(temperature=1.0, seed=seed, ignore_eos=True, max_tokens=steps + 1)
    for tokens in [long] + [short] * (batch - 1):
        engine.add_request(torch.randint(0, vocab, (tokens,), generator=g).tolist(), params)
    decode = [s for s, pre, n in timed_steps(engine, CLOCKS[clock]) if not pre and n == batch]
    if len(decode) != steps:
        raise RuntimeError(f"expected {steps} decode steps of batch {batch}, got {len(decode)}")
    return statistics.median(decode)


def skewed_rows(model: Path, clock: str, grid: ProfileGrid) -> list[DecodeRow]:
    """Decode rows of skewed batches, measured the way the profiler measures its cells (the
    profiling engine's budgets, interleaved passes, median of passes)."""
    engine = Engine(profile_engine_config(engine_config(model), grid))
    samples: dict[tuple[int, int, int], list[float]] = {cell: [] for cell in SKEWED_CELLS}
    seed = 0
    measure_skewed(engine, 8, 16, 300, grid.warmup_steps, 1 << 30, clock)
    for _ in range(grid.passes):
        for cell in SKEWED_CELLS:
            samples[cell].append(measure_skewed(engine, *cell, grid.decode_steps, seed, clock))
            seed += 1
    middle = 1 + (grid.decode_steps - 1) / 2  # the middle timed step, as the profiler counts
    return [
        DecodeRow(
            tp=1,
            batch=b,
            context_tokens=round(long + (b - 1) * short + b * middle),
            max_context=round(long + middle),
            seconds=statistics.median(t),
        )
        for (b, short, long), t in samples.items()
    ]


def _mape(model: LatencyModel, rows: list[DecodeRow]) -> float:
    pred = [float(model.step_time(1, r.batch, r.context_tokens, r.max_context)) for r in rows]
    return statistics.median(
        abs(p - r.seconds) / r.seconds for p, r in zip(pred, rows, strict=True)
    )


def skew_errors(profile: Profile, skewed: list[DecodeRow]) -> dict[str, Any]:
    """Error on the skewed rows of a fit without them, and of fits with the other half."""
    blind = LatencyModel.fit(profile)
    halves = [skewed[0::2], skewed[1::2]]
    with_half = []
    forms = []
    for test, train in (halves, halves[::-1]):
        fit = LatencyModel.fit(profile.model_copy(update={"decode": profile.decode + train}))
        forms.append(fit.step_fits[1].form)
        with_half.append(_mape(fit, test))
    told = LatencyModel.fit(profile, context_form="padded")
    return {
        "skewed_mape_fit_without_them": _mape(blind, skewed),
        "skewed_mape_fit_without_them_told_padded": _mape(told, skewed),
        "skewed_mape_fit_with_other_half": statistics.median(with_half),
        "forms_with_skewed_rows": forms,
        "fit_with_all": LatencyModel.fit(
            profile.model_copy(update={"decode": profile.decode + skewed})
        ).describe()[1],
    }


def one_setting(
    model: Path, dp: int, clock: str, repeats: int, requests: int, skewed: list[DecodeRow]
) -> dict[str, Any]:
    start = time.perf_counter()
    groups = long_tail_groups(requests)
    runs, sims, profiles = measure(model, groups, dp, clock, repeats)
    same_schedule = all(
        simulated_steps(sim, i) == (run.prefill_steps, run.decode_batches)
        for replicas, sim in zip(runs, sims, strict=True)
        for i, run in enumerate(replicas)
    )
    measured = [measured_total(r) for r in runs]
    simulated = [s.total_s for s in sims]
    ratios = [s / m for s, m in zip(simulated, measured, strict=True)]
    padded_ratios = []
    for profile, m in zip(profiles, measured, strict=True):
        latency = LatencyModel.fit(profile.model_copy(update={"decode": profile.decode + skewed}))
        sim = RolloutSimulator(latency, dp, sim_config()).run(groups, StaticPolicy(Layout(dp, 1)))
        padded_ratios.append(sim.total_s / m)
    held_out = [held_out_error(p, seed=seed)[1] for p in profiles for seed in range(5)]
    return {
        "dp": dp,
        "clock": clock,
        "measured_s": measured,
        "simulated_s": simulated,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "within_tolerance": abs(statistics.median(ratios) - 1) <= TOLERANCE,
        "padded_ratios": padded_ratios,
        "median_padded_ratio": statistics.median(padded_ratios),
        "same_schedule": same_schedule,
        "latency_model_held_out_mape_median": statistics.median(held_out),
        "skew": skew_errors(profiles[-1], skewed),
        "seconds": time.perf_counter() - start,
        "loadavg": os.getloadavg(),
    }


def profile_cost(model: Path) -> dict[str, Any]:
    """Wall time of the profiler's quick grid (TP 1, in process; torch already imported)."""
    from patrl.rollout.profile import profile_single, quick_grid

    base = EngineConfig(model=str(model), dtype="float32", device="cpu")
    start = time.perf_counter()
    profile = profile_single(base, quick_grid())
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    profile_single(base, fidelity_grid("wall"))
    return {
        "quick_grid_s": seconds,
        "quick_grid_rows": len(profile.decode) + len(profile.prefill),
        "fidelity_grid_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import tempfile

    model = build_model(Path(tempfile.mkdtemp()))
    report: dict[str, Any] = {"profile_cost": profile_cost(model), "settings": []}
    print(f"profiler cost (wall, TP 1): {report['profile_cost']}")
    print(f"{'clock':<5} {'dp':>2} {'measured s':>11} {'simulated s':>12} {'sim/meas':>9} "
          f"{'ok':>3} {'sim/meas padded':>15} {'schedule':>8} {'held-out':>8} "
          f"{'skew err w/o':>12} {'w/o, told':>9} {'skew err with':>13} {'load':>5}")  # fmt: skip
    for clock in ("wall", "cpu"):
        skewed = skewed_rows(model, clock, fidelity_grid(clock))
        report.setdefault("skewed_rows", {})[clock] = [r.model_dump() for r in skewed]
        for dp in (1, 2):
            row = one_setting(model, dp, clock, args.repeats, args.requests, skewed)
            report["settings"].append(row)
            print(
                f"{clock:<5} {dp:>2} {statistics.median(row['measured_s']):>11.3f} "
                f"{statistics.median(row['simulated_s']):>12.3f} {row['median_ratio']:>9.3f} "
                f"{'yes' if row['within_tolerance'] else 'NO':>3} "
                f"{row['median_padded_ratio']:>15.3f} "
                f"{'same' if row['same_schedule'] else 'DIFF':>8} "
                f"{row['latency_model_held_out_mape_median']:>8.3f} "
                f"{row['skew']['skewed_mape_fit_without_them']:>12.3f} "
                f"{row['skew']['skewed_mape_fit_without_them_told_padded']:>9.3f} "
                f"{row['skew']['skewed_mape_fit_with_other_half']:>13.3f} "
                f"{row['loadavg'][0]:>5.1f}",
                flush=True,
            )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "simulator_fidelity.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
