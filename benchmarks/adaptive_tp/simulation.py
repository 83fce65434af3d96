"""The rollout simulator fed each workload's measured lengths and the fitted latency model:
simulated against measured for every policy, and what switching for free would take."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from patrl.lenpredict import (
    AdaptivePolicy,
    LatencyModel,
    Layout,
    PlannerConfig,
    Profile,
    ReconfigPlanner,
    RolloutSimulator,
    SimConfig,
    StaticPolicy,
    lockstep_free_switch,
)

from .config import MARGIN
from .shapes import BLOCK, Scale
from .workloads import Workload


def simulator_for(
    latency: LatencyModel, scale: Scale, seqs: int, check_every: int, margin: float = MARGIN
) -> tuple[RolloutSimulator, PlannerConfig]:
    """The rollout simulator and planner settings of this bench's engines (2 ranks, LPT,
    a check every `check_every` decode steps) for rollouts of `seqs` sequences."""
    config = SimConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=max(2048, scale.max_model_len),
        block_size=BLOCK,
        plan_interval_steps=check_every,
        assignment="lpt",
    )
    planner_config = PlannerConfig(candidate_tp=(1, 2), margin=margin, max_num_seqs=seqs)
    return RolloutSimulator(latency, 2, config), planner_config


def simulate(
    out: dict[str, Any],
    profile: Profile,
    workloads: list[Workload],
    scale: Scale,
    check_every: int,
    margin: float = MARGIN,
) -> None:
    """Add to each workload of a shape's results `out` its simulated time per policy and
    `lockstep_free_switch`, the simulator fed the measured lengths and this profile's model."""
    latency = LatencyModel.fit(profile)
    seqs = scale.num_prompts * scale.n
    sim, planner_config = simulator_for(latency, scale, seqs, check_every, margin)
    for workload in workloads:
        entry = out["workloads"][workload.name]
        groups = workload.prompt_groups()
        tp = statistics.mode(entry["policies"]["adaptive_oracle"]["opening_tp"] or [1])
        policies: dict[str, StaticPolicy | AdaptivePolicy] = {
            "static_dp2_tp1": StaticPolicy(Layout(dp=2, tp=1)),
            "static_dp1_tp2": StaticPolicy(Layout(dp=1, tp=2)),
            # where the measured runs opened (the first check's choice of the rollout before)
            "adaptive_oracle": AdaptivePolicy(
                ReconfigPlanner(latency, 2, planner_config), start=Layout(dp=2 // tp, tp=tp)
            ),
            "adaptive_cold": AdaptivePolicy(
                ReconfigPlanner(latency, 2, planner_config), start=Layout(dp=2, tp=1)
            ),
        }
        free = lockstep_free_switch(
            latency,
            Layout(dp=2, tp=1),
            Layout(dp=1, tp=2),
            np.repeat(workload.lengths, workload.n),
            np.repeat([len(p) for p in workload.prompts], workload.n),
            np.repeat(workload.replica_split(), workload.n),
        )
        entry["lockstep_free_switch"] = {
            "dp2_s": free.wide_s,
            "tp2_s": free.narrow_s,
            "free_s": free.free_s,
            "ratio": free.ratio,
        }
        for name, policy in policies.items():
            result = sim.run(groups, policy)  # split on the true lengths, as measured
            measured = entry["policies"][name]["median_s"]
            entry["policies"][name]["simulated_s"] = result.total_s
            entry["policies"][name]["sim_over_measured"] = result.total_s / measured
            entry["policies"][name]["simulated_switches"] = [list(s) for s in result.switches]
