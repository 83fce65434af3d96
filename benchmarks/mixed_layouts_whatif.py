"""SIMULATED what-if: would *mixed* layouts reach issue 7's 30%, where uniform folds stop at ~18%?

    python benchmarks/mixed_layouts_whatif.py        (~2 min; writes results/mixed_layouts_whatif.json)

simulate_cluster's setting (one 8xH100 node, calibrated step model, 128 prompts x 8 samples of
DeepScaleR-like lengths, max_num_seqs 256 per replica, the first of its three steps) gave, on
the uncalibrated roofline of 2026-11-24, adaptive TP -18% (Llama-3.1-8B) / -23% (Qwen3-14B)
against verl's static TP 2, while the KV-read lower bound allowed -36% / -41%. The bound lets the long tail run beside the KV-bound
bulk; uniform folds (every replica at one TP size, as the planner, the simulator and the engine
do) cannot. The natural next design is a mixed layout: fold two TP-2 replicas into one TP-4
group, move the longest-remaining sequences there (token-level migration), keep the other two
replicas decoding the bulk at TP 2, and fold everything into TP 8 later.

Before building that into the planner, simulator and engine, this script bounds it. A small
event simulator (each replica steps on its own clock; a regroup waits for every replica and
pays the latency model's switch and KV prices; prefill once per prompt group and replica;
LPT placement on true lengths) runs, with ORACLE lengths and a grid search over the schedule:
- static TP 2 / 4 / 8, and the schedule of uniform folds that patrl's planner chose in the
  RolloutSimulator, replayed (calibration against the real simulator);
- the best uniform schedule TP 2 -> 4 -> 8 over a grid of fold times;
- the best mixed schedule: at t1, one TP-4 group holding the k longest-remaining sequences
  beside two TP-2 replicas; at t2 (or never), everything to TP 8.
Reported: each time and its change against static TP 2 with the same LPT split, and against
verl's default (static TP 2, round-robin split, in the RolloutSimulator: the headline's base).

Result (2026-11-24, uncalibrated roofline): the best mixed schedule beat the best uniform one
by 1.2-1.5 points. Rerun 2026-11-26 on the calibrated step model (roofline.py, fitted to
published measurements): the best mixed schedule (a TP-4 group for the 64 longest sequences
beside two TP-2 replicas from 20 s) takes -16.0% (Llama-3.1-8B) / -17.5% (Qwen3-14B) against
verl's default, the best uniform schedule -9.4% / -12.4%, the planner's folds replayed -10.7% /
-13.6%: mixed layouts now add 5-6 points, since TP 8 no longer runs the tail faster than TP 4.
The small simulator matches the RolloutSimulator on static TP 2 (179.8 s both) and on the
planner's folds replayed (170.2 vs 171.6 s).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from patrl.lenpredict import (
    LLAMA31_8B,
    QWEN3_14B,
    LatencyModel,
    Layout,
    ModelInfo,
    PlannerConfig,
    PromptGroup,
    group_by_step,
    long_tail_trace,
    roofline_profile,
)
from patrl.lenpredict.assignment import longest_processing_time
from patrl.lenpredict.simulate import PolicySpec, run_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import simulate_cluster as cluster  # a sibling script, not a package

RESULTS = Path(__file__).parent / "results"
WORLD, MAX_SEQS = 8, 256
T1 = (0.0, 10.0, 20.0, 30.0, 40.0)  # s: when the TP-4 group for the longest forms
K = (8, 16, 32, 64, 128)  # sequences it takes
T2 = (40.0, 60.0, 80.0, 100.0, float("inf"))  # s: when everything folds into TP 8 (inf: never)
UNIFORM = [(a, b) for a in (20.0, 30.0, 35.0, 40.0, 50.0) for b in (50.0, 60.0, 70.0, 80.0, 90.0)]


class Rollout:
    """Sequences of one rollout (arrays over samples) and the replicas decoding them."""

    def __init__(self, latency: LatencyModel, groups: list[PromptGroup]) -> None:
        self.latency = latency
        self.groups = groups
        self.prompt = np.array([g.prompt_tokens for g in groups for _ in g.response_tokens], float)
        self.length = np.array([t for g in groups for t in g.response_tokens], float)
        self.group = np.array([i for i, g in enumerate(groups) for _ in g.response_tokens])
        self.done = np.zeros(len(self.length))  # tokens generated

    def remaining(self, seqs: list[int]) -> np.ndarray:
        return self.length[seqs] - self.done[seqs]

    def lpt(self, seqs: list[int], k: int) -> list[list[int]]:
        """Longest remaining first onto the least-loaded of k replicas."""
        return _lpt_parts(self.remaining(seqs), [[s] for s in seqs], k)

    def lpt_groups(self, k: int) -> list[list[int]]:
        """Whole prompt groups (their n samples share a prefill), most tokens first."""
        work = [sum(g.response_tokens) for g in self.groups]
        members = [np.flatnonzero(self.group == g).tolist() for g in range(len(self.groups))]
        return _lpt_parts(work, members, k)


def _lpt_parts(work, items: list[list[int]], k: int) -> list[list[int]]:
    """patrl's LPT split (`longest_processing_time`), each replica's items queued largest
    first."""
    replica_of = longest_processing_time(work, k)
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in np.argsort(-np.asarray(work, dtype=float), kind="stable").tolist():
        parts[replica_of[i]] += items[i]
    return parts


class Replica:
    def __init__(self, run: Rollout, tp: int, seqs: list[int], clock: float) -> None:
        self.run, self.tp, self.clock = run, tp, clock
        self.queue = list(seqs)
        self.running = np.zeros(0, dtype=int)
        self.prefilled: set[int] = set()

    def busy(self) -> bool:
        return len(self.running) > 0 or len(self.queue) > 0

    def seqs(self) -> list[int]:
        return self.running.tolist() + self.queue

    def _admit(self) -> None:
        room = MAX_SEQS - len(self.running)
        if room <= 0 or not self.queue:
            return
        new, self.queue = self.queue[:room], self.queue[room:]
        run = self.run
        fresh = {int(run.group[s]): s for s in new if run.done[s] == 0}
        tokens = sum(run.prompt[s] for g, s in fresh.items() if g not in self.prefilled)
        self.prefilled |= set(fresh)
        if tokens:
            self.clock += float(run.latency.prefill_time(self.tp, [tokens]))
        self.running = np.r_[self.running, np.array(new, dtype=int)]

    def run_until(self, t: float) -> None:
        """Decode until the clock passes t or nothing is left; an idle replica waits for t."""
        run = self.run
        while self.clock < t:
            self._admit()
            if len(self.running) == 0:
                if np.isfinite(t):
                    self.clock = t
                return
            context = float((run.prompt[self.running] + run.done[self.running]).sum())
            self.clock += float(run.latency.step_time(self.tp, len(self.running), context))
            run.done[self.running] += 1
            self.running = self.running[run.done[self.running] < run.length[self.running]]


def regroup(run: Rollout, replicas: list[Replica], tps: list[int], parts) -> list[Replica]:
    """Every replica stops; the slowest sets the clock; the switch and KV prices are paid."""
    t = max(r.clock for r in replicas)
    seqs = [s for r in replicas for s in r.seqs()]
    tokens = float((run.prompt[seqs] + run.done[seqs]).sum()) if seqs else 0.0
    src, dst = replicas[0].tp, max(tps)
    t += run.latency.switch_time(src, dst, WORLD) + run.latency.switch_kv_time(src, dst, tokens)
    return [Replica(run, tp, part, t) for tp, part in zip(tps, parts(seqs), strict=True)]


def finish(replicas: list[Replica]) -> float:
    for r in replicas:
        r.run_until(float("inf"))
    return max(r.clock for r in replicas)


def static(latency: LatencyModel, groups: list[PromptGroup], tp: int) -> float:
    run = Rollout(latency, groups)
    return finish([Replica(run, tp, part, 0.0) for part in run.lpt_groups(WORLD // tp)])


def uniform(latency: LatencyModel, groups: list[PromptGroup], folds: list[tuple[float, int]]):
    """TP 2 from the start, then every replica folds to `tp` at each (t, tp)."""
    run = Rollout(latency, groups)
    replicas = [Replica(run, 2, part, 0.0) for part in run.lpt_groups(WORLD // 2)]
    for t, tp in folds:
        for r in replicas:
            r.run_until(t)
        replicas = regroup(
            run, replicas, [tp] * (WORLD // tp), lambda s, k=WORLD // tp: run.lpt(s, k)
        )
    return finish(replicas)


def mixed(latency: LatencyModel, groups: list[PromptGroup], t1: float, k: int, t2: float):
    """TP 2 from the start; at t1 one TP-4 group takes the k longest-remaining sequences and two
    TP-2 replicas the rest; at t2 everything folds into TP 8."""
    run = Rollout(latency, groups)
    replicas = [Replica(run, 2, part, 0.0) for part in run.lpt_groups(WORLD // 2)]
    for r in replicas:
        r.run_until(t1)

    def split(seqs: list[int]) -> list[list[int]]:
        order = [seqs[i] for i in np.argsort(-run.remaining(seqs), kind="stable")]
        return [order[:k], *run.lpt(order[k:], 2)]

    replicas = regroup(run, replicas, [4, 2, 2], split)
    for r in replicas:
        r.run_until(t2)
    if np.isfinite(t2) and any(r.busy() for r in replicas):
        replicas = regroup(run, replicas, [8], lambda s: [s])
    return finish(replicas)


def planner_schedule(latency: LatencyModel, groups: list[PromptGroup]) -> dict[str, Any]:
    """patrl's planner in the RolloutSimulator (oracle lengths, LPT): its time and its folds."""
    results = run_policy(
        PolicySpec.parse("adaptive"),
        {0: groups},
        latency,
        WORLD,
        cluster.sim_config("lpt"),
        PlannerConfig(max_num_seqs=MAX_SEQS),
    )
    static2 = {
        assignment: run_policy(
            PolicySpec.parse("static:2"),
            {0: groups},
            latency,
            WORLD,
            cluster.sim_config(assignment),
            PlannerConfig(max_num_seqs=MAX_SEQS),
        )[0].total_s
        for assignment in ("lpt", "round_robin")
    }
    folds = [(t, Layout.parse(dst).tp) for t, src, dst in results[0].switches if t > 1e-3]
    return {
        "adaptive_s": results[0].total_s,
        "static2_s": static2["lpt"],
        "verl_default_s": static2["round_robin"],
        "folds": folds,
    }


def whatif(model: ModelInfo) -> dict[str, Any]:
    latency = LatencyModel.fit(roofline_profile(model))
    groups = group_by_step(
        long_tail_trace(cluster.SPEC, cluster.PROMPTS, cluster.SAMPLES, steps=1, seed=0)
    )[0]
    real = planner_schedule(latency, groups)
    times = {f"static:{tp}": static(latency, groups, tp) for tp in (2, 4, 8)}
    times["planner's folds, replayed"] = uniform(latency, groups, real["folds"])
    best_uniform = min(
        (uniform(latency, groups, [(a, 4), (b, 8)]), a, b) for a, b in UNIFORM if b > a
    )
    times["best uniform 2->4->8"] = best_uniform[0]
    grid = [
        (mixed(latency, groups, t1, k, t2), t1, k, t2)
        for t1, k, t2 in itertools.product(T1, K, T2)
        if t2 > t1
    ]
    best_mixed = min(grid)
    times["best mixed (4 + 2 + 2) -> 8"] = best_mixed[0]
    base, verl = times["static:2"], real["verl_default_s"]
    return {
        "model": model.name,
        "times_s": times,
        "vs_static2": {name: t / base - 1 for name, t in times.items()},
        # the headline's baseline: static TP 2 with verl's round-robin split, RolloutSimulator
        "verl_default_s": verl,
        "vs_verl_default": {name: t / verl - 1 for name, t in times.items()},
        "best_uniform_folds_s": {"to_tp4": best_uniform[1], "to_tp8": best_uniform[2]},
        "best_mixed": {"t1_s": best_mixed[1], "k": best_mixed[2], "t2_s": best_mixed[3]},
        "calibration": {
            "rollout_simulator_static2_s": real["static2_s"],
            "rollout_simulator_adaptive_s": real["adaptive_s"],
            "planner_folds": real["folds"],
        },
    }


def main() -> None:
    rows = [whatif(m) for m in (LLAMA31_8B, QWEN3_14B)]
    print("SIMULATED (roofline 8xH100, 128x8 DeepScaleR-like, oracle lengths, first step)")
    for row in rows:
        cal = row["calibration"]
        print(
            f"\n{row['model']}: RolloutSimulator static:2 {cal['rollout_simulator_static2_s']:.1f} s,"
            f" planner {cal['rollout_simulator_adaptive_s']:.1f} s (folds {cal['planner_folds']});"
            f" verl default (static:2, round-robin) {row['verl_default_s']:.1f} s"
        )
        for name, t in row["times_s"].items():
            print(
                f"  {name:30s} {t:7.1f} s  {row['vs_static2'][name]:+6.1%} vs static:2 (LPT)"
                f"  {row['vs_verl_default'][name]:+6.1%} vs verl default"
            )
        print(f"  best mixed schedule: {row['best_mixed']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "mixed_layouts_whatif.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"label": "SIMULATED", "rows": rows}, indent=1, default=float))
    tmp.replace(out)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
