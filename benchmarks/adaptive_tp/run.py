"""The measured runs: one engine per policy on both ranks, timed rollouts of every workload,
and each workload's summary (medians, ratios to the best static, control overhead, audit).

Every engine is built by `make_engine`, the one place that constructs one.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from patrl.lenpredict import Profile
from patrl.rollout import (
    AdaptiveEngine,
    AdaptiveTP,
    Engine,
    EngineConfig,
    OracleLengths,
    RequestOutput,
    plot_timeline,
)
from patrl.rollout.loader import iter_checkpoint
from patrl.tpreshard import GroupCache

from .config import ADAPTIVE, POLICIES, STATIC, BenchConfig
from .profiles import profile_shape, profile_summary, profiled_with
from .shapes import Scale, base_config, build_model, model_dir, shape_config
from .simulation import simulate
from .workloads import Workload, make_workloads


@dataclass(slots=True)
class Engines:
    """One engine per policy on this rank; `oracle_lengths` is what the oracle engine is told."""

    static_dp: Engine
    static_tp: Engine
    predicted: AdaptiveEngine
    oracle: AdaptiveEngine
    oracle_lengths: OracleLengths
    cold: AdaptiveEngine

    def of(self, policy: str) -> Engine | AdaptiveEngine:
        engines: dict[str, Engine | AdaptiveEngine] = {
            "static_dp2_tp1": self.static_dp,
            "static_dp1_tp2": self.static_tp,
            "adaptive_predicted": self.predicted,
            "adaptive_oracle": self.oracle,
            "adaptive_cold": self.cold,
        }
        return engines[policy]


def adaptive_config(
    base: EngineConfig, profile: str, check_every: int, margin: float
) -> EngineConfig:
    """`base` with adaptive TP over tp 1 and 2, planning on the profile at `profile`."""
    policy = AdaptiveTP(
        candidates=(1, 2),
        check_every=check_every,
        margin=margin,
        kv_policy="auto",
        profile=profile,
    )
    return base.model_copy(update={"tp_policy": policy})


def make_engines(
    base: EngineConfig, profile: str, groups: GroupCache, check_every: int, margin: float
) -> Engines:
    """Every policy's engine; all ranks build them in the same order."""
    adaptive = adaptive_config(base, profile, check_every, margin)
    oracle = OracleLengths({})
    return Engines(
        static_dp=Engine(base, groups.layout(1), groups),
        static_tp=Engine(base, groups.layout(2), groups),
        predicted=AdaptiveEngine(adaptive, groups=groups),
        oracle=AdaptiveEngine(adaptive, groups=groups, lengths=oracle),
        oracle_lengths=oracle,
        cold=AdaptiveEngine(adaptive, groups=groups),
    )


def reopen_wide(engine: AdaptiveEngine) -> None:
    """Make an adaptive engine open its next rollout at its policy's start_tp (tp 1), so only
    the mid-rollout planner moves it (PAT's setting)."""
    controller = engine.controller
    assert controller is not None and engine.groups is not None
    controller.opening_tp = controller.policy.start_tp
    engine.return_later(engine.groups.layout(controller.policy.start_tp))


def my_share(policy: str, workload: Workload, replica_of: list[int], rank: int) -> list[int]:
    """Prompt indices this rank generates: its replica's, or all of them at tp 2."""
    if policy == "static_dp1_tp2":
        return list(range(len(workload.prompts)))
    return [i for i, r in enumerate(replica_of) if r == rank]


def tell_oracle(engines: Engines, workload: Workload, mine: list[int], world: Any) -> None:
    """Every rank's request ids of the coming rollout with their lengths, to every rank (rank
    0 plans for all replicas)."""
    engine = engines.oracle
    first = engine.engine.next_request_number()
    rank = dist.get_rank(world)
    lengths = {
        (f"req-{rank}-{first + j}", k): workload.lengths[i]
        for j, i in enumerate(mine)
        for k in range(workload.n)
    }
    gathered: list[Any] = [None] * dist.get_world_size(world)
    dist.all_gather_object(gathered, lengths, group=world)
    for part in gathered:
        engines.oracle_lengths.final.update(part)


def rollout(
    engines: Engines,
    policy: str,
    workload: Workload,
    replica_of: list[int],
    world: Any,
) -> dict[str, Any]:
    """One timed rollout of `workload` by `policy`'s engine on every rank: the weight sync
    first (untimed, reported as `sync_s`), then `generate` between barriers. Returns the
    slowest rank's latency, every rank's, and for adaptive policies the controller's counters
    of this rollout, its decisions and its timeline."""
    rank = dist.get_rank(world)
    engine = engines.of(policy)
    mine = my_share(policy, workload, replica_of, rank)
    if policy == "adaptive_oracle":
        tell_oracle(engines, workload, mine, world)
    params = workload.params()
    if policy == "adaptive_cold":
        reopen_wide(engines.cold)
    # the RL step's weight sync, untimed: an adaptive engine goes back to its opening layout
    # in it (the model rebuilt there from the full tensors), as it does in the RL loop
    dist.barrier(group=world)
    start = time.perf_counter()
    version = (engine.engine if isinstance(engine, AdaptiveEngine) else engine).weight_version
    engine.load_weights(iter_checkpoint(engine.config.model), version + 1)
    sync_s = time.perf_counter() - start
    before = engine.stats()
    dist.barrier(group=world)
    start = time.perf_counter()
    outs = engine.generate(
        [workload.prompts[i] for i in mine],
        [params[i] for i in mine],
        prompt_keys=[workload.keys()[i] for i in mine],
    )
    seconds = time.perf_counter() - start
    check_lengths(outs, [workload.lengths[i] for i in mine], policy)
    stats = engine.stats()
    times: list[Any] = [None] * dist.get_world_size(world)
    dist.all_gather_object(times, (seconds, sync_s), group=world)
    record: dict[str, Any] = {
        "latency_s": max(t for t, _ in times),
        "sync_s": max(t for _, t in times),
        "rank_s": [t for t, _ in times],
    }
    if policy.startswith("adaptive"):
        keys = ("tp_control_s", "tp_decode_s", "tp_critical_control_s", "tp_critical_decode_s")
        for key in (*keys, "tp_planner_s", "tp_reconfig_s", "tp_reset_s"):
            record[key] = stats[key] - before[key]
        record["switches"] = int(stats["tp_switches"] - before["tp_switches"])
        record["checks"] = int(stats["tp_checks"] - before["tp_checks"])
        record["decisions"] = stats["tp_decisions"]
        record["timeline"] = stats["timeline"]
    return record


def check_lengths(outs: Sequence[RequestOutput], lengths: list[int], policy: str) -> None:
    """The benchmark imposes every length: a different one means the comparison is void."""
    for out, want in zip(outs, lengths, strict=True):
        got = [len(c.token_ids) for c in out.outputs]
        if got != [want] * len(got):
            raise RuntimeError(f"{policy}: request {out.request_id} generated {got}, not {want}")


def run_shape(
    shape: str, scale: Scale, repeats: int, world: Any, bench: BenchConfig
) -> dict[str, Any]:
    """Profile `shape` (or reuse its profile), then unless `bench.profile_only` time every
    policy on every workload `repeats` times. Returns the shape's results (rank 0's are
    complete: the simulator runs there)."""
    rank = dist.get_rank(world)
    if rank == 0:
        build_model(shape, bench.results)
    dist.barrier(group=world)
    base = base_config(model_dir(shape, bench.results), scale)
    profile_path = bench.results / f"adaptive_tp_profile_{shape}{bench.suffix}.json"
    if bench.reuse_profile and profiled_with(profile_path, scale):
        log(rank, f"[{shape}] reusing {profile_path}")
        profile_s = 0.0
    else:
        log(rank, f"[{shape}] profiling ...")
        profile_s = profile_shape(base, scale, profile_path, world)
    profile = Profile.load(profile_path)
    summary = profile_summary(profile, scale.num_prompts * scale.n, scale.context_per_seq)
    log(rank, f"[{shape}] profile in {profile_s:.0f} s: {json.dumps(summary)}")
    if bench.profile_only:
        return {"profile_path": str(profile_path), "profile_s": profile_s, "profile": summary}

    check_every = bench.check_every_for(scale)
    groups = GroupCache([1, 2], world_size=dist.get_world_size(world), rank=rank)
    engines = make_engines(base, str(profile_path), groups, check_every, bench.margin)
    workloads = make_workloads(scale, profile.model.vocab_size)
    warm = Workload("warmup", workloads[0].prompts[:2], [4, 4], scale.n)
    for policy in POLICIES:  # first steps of an engine pay one-off allocations
        rollout(engines, policy, warm, [0, 1], world)
    out: dict[str, Any] = {
        "shape": {**shape_config(shape), "num_params": profile.model.num_params},
        "profile_path": str(profile_path),
        "profile_s": profile_s,
        "profile": summary,
        "check_every": check_every,
        "workloads": {},
    }
    timeline_png = bench.results / f"adaptive_tp_timeline_{shape}{bench.suffix}.png"
    for workload in workloads:
        replica_of = workload.replica_split()
        runs = time_policies(engines, workload, replica_of, repeats, world, shape)
        if workload.name == "long_tail" and rank == 0:
            last = runs["adaptive_cold"][-1]  # opens wide: the planner's switch shows
            plot_timeline(
                last["timeline"],
                last["decisions"],
                timeline_png,
                title=f"{shape}: adaptive opened at tp 1 (predicted lengths), long-tail, rank 0",
            )
        out["workloads"][workload.name] = summarise(workload, replica_of, runs, scale)
    if rank == 0:
        simulate(out, profile, workloads, scale, check_every, bench.margin)
    return out


def time_policies(
    engines: Engines,
    workload: Workload,
    replica_of: list[int],
    repeats: int,
    world: Any,
    shape: str,
) -> dict[str, list[dict[str, Any]]]:
    """Each policy's rollout records of `workload`, `repeats` of them, the policies in turn
    (interleaved, so load drifts hit all alike) and each repeat starting one policy later
    (a policy's place in the order moves its time). One untimed rollout per adaptive policy
    first: the online predictor gets this prompt set's history and every adaptive engine's
    first check names where this batch opens (steady-state RL)."""
    rank = dist.get_rank(world)
    for policy in ADAPTIVE:
        rollout(engines, policy, workload, replica_of, world)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for rep in range(repeats):
        shift = rep % len(POLICIES)
        for policy in POLICIES[shift:] + POLICIES[:shift]:
            runs[policy].append(rollout(engines, policy, workload, replica_of, world))
            seconds = runs[policy][-1]["latency_s"]
            log(rank, f"[{shape}] {workload.name} rep {rep} {policy}: {seconds:.2f} s")
    return runs


def summarise(
    workload: Workload, replica_of: list[int], runs: dict[str, list[dict[str, Any]]], scale: Scale
) -> dict[str, Any]:
    """A workload's results: per policy its latencies, median, ratios to the best static
    (of medians, and paired per repeat), sync times, and for adaptive policies the control
    overhead and the switch audit."""
    medians = {p: statistics.median(r["latency_s"] for r in runs[p]) for p in POLICIES}
    best = min(STATIC, key=lambda p: medians[p])
    policies: dict[str, Any] = {}
    for p in POLICIES:
        entry: dict[str, Any] = {
            "latency_s": [r["latency_s"] for r in runs[p]],
            "median_s": medians[p],
            "vs_best_static": medians[p] / medians[best],
            # each repeat against the best static run of the same repeat (they ran back to
            # back, so a slow stretch of this shared box hits both): less noisy than the above
            "paired_vs_best_static": statistics.median(
                a["latency_s"] / b["latency_s"] for a, b in zip(runs[p], runs[best], strict=True)
            ),  # (print_report derives it from latency_s, for files written before it)
            "sync_s": [r["sync_s"] for r in runs[p]],
        }
        if p.startswith("adaptive"):
            control = sum(r["tp_control_s"] for r in runs[p])
            decode = sum(r["tp_decode_s"] for r in runs[p])
            critical = sum(r["tp_critical_control_s"] for r in runs[p])
            critical_decode = sum(r["tp_critical_decode_s"] for r in runs[p])
            entry.update(
                switches=[r["switches"] for r in runs[p]],
                checks=[r["checks"] for r in runs[p]],
                opening_tp=[r["timeline"][0]["tp_size"] for r in runs[p] if r["timeline"]],
                # rank 0's own check time, waiting for a busier replica included
                control_s=control,
                decode_s=decode,
                rank0_control_fraction=control / decode if decode else None,
                # what control (checks, and the waits they impose) added to the critical
                # path (see patrl.rollout.adaptive.critical_path)
                critical_control_s=critical,
                critical_decode_s=critical_decode,
                control_fraction=critical / critical_decode if critical_decode else None,
                planner_s=sum(r["tp_planner_s"] for r in runs[p]),
                reconfig_s=sum(r["tp_reconfig_s"] for r in runs[p]),
                reset_s=sum(r["tp_reset_s"] for r in runs[p]),
                switch_decisions=audit(runs[p], runs["static_dp2_tp1"]),
            )
        policies[p] = entry
    return {
        "lengths": workload.lengths,
        "prompt_tokens": [len(p) for p in workload.prompts],
        "n": workload.n,
        "prompt_ids": list(workload.prompt_ids) if workload.prompt_ids else None,
        "replica_of": replica_of,
        "best_static": best,
        "policies": policies,
    }


def audit(runs: list[dict[str, Any]], static_dp: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each switch decision with its prediction and what was measured. Up to the switch the
    adaptive rollout runs the static (dp2, tp1) schedule, so that run of the same repeat, less
    the switch time, stands in for "had it stayed" (net of the check overhead between them)."""
    out = []
    for rep, (run, static) in enumerate(zip(runs, static_dp, strict=True)):
        for d in run["decisions"]:
            if d["action"] != "switch":
                continue
            stay_s = static["latency_s"] - d["t"]
            measured_net = stay_s - d["measured_finish_s"]
            out.append(
                {
                    "repeat": rep,
                    "t": d["t"],
                    "tp": f"{d['current_tp']}->{d['target_tp']}",
                    "num_seqs": d["num_seqs"],
                    "migrated": d["num_migrated"],
                    "recomputed": d["num_recomputed"],
                    "predicted_gain_s": d["predicted_gain_s"],
                    "predicted_overhead_s": d["predicted_overhead_s"],
                    "predicted_net_s": d["predicted_gain_s"] - d["predicted_overhead_s"],
                    "predicted_finish_s": d["predicted_finish_s"],
                    "measured_overhead_s": d["measured_overhead_s"],
                    "measured_finish_s": d["measured_finish_s"],
                    "measured_stay_finish_s": stay_s,
                    "measured_net_s": measured_net,
                    "measured_gain_s": measured_net + (d["measured_overhead_s"] or 0.0),
                }
            )
    return out


def log(rank: int, message: str) -> None:
    """Print `message` with the time of day, on rank 0 only."""
    if rank == 0:
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)
