"""The latency profile each shape's adaptive engines plan with: measured once per shape on
both ranks (`patrl.rollout.profile.profile_distributed`), summarised for the report."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from patrl.lenpredict import LatencyModel, Layout, Profile, adaptive_ceiling
from patrl.rollout import EngineConfig
from patrl.rollout.profile import profile_distributed, write_atomic

from .shapes import Scale


def grids_note(scale: Scale) -> str:
    """How a profile names the grids it measured (`profiled_with` compares it)."""
    return " + ".join(repr(g) for g in scale.grids)


def profile_shape(base: EngineConfig, scale: Scale, path: Path, world: Any) -> float:
    """Profile every grid on all ranks; rank 0 merges the rows and writes `path` atomically.
    Returns the seconds it took."""
    start = time.perf_counter()
    profiles = [profile_distributed(base, grid, world) for grid in scale.grids]
    if dist.get_rank(world) == 0:
        first = profiles[0]
        assert first is not None
        merged = first.model_copy(
            update={
                "decode": [r for p in profiles if p for r in p.decode],
                "prefill": [r for p in profiles if p for r in p.prefill],
                "switches": [r for p in profiles if p for r in p.switches],
                "notes": {**first.notes, "grid": grids_note(scale)},
            }
        )
        write_atomic(merged, path)
    dist.barrier(group=world)
    return time.perf_counter() - start


def profile_summary(profile: Profile, rollout_batch: int, ctx: int = 32) -> dict[str, Any]:
    """Measured step times at tp 1 and 2 for batch 1 and the largest batch (shortest context),
    and whether the fitted model has a crossover where the rollouts can use it: TP=2 faster
    for one sequence, two tp-1 replicas faster for the rollouts' full batch (`rollout_batch`
    sequences: half per replica at tp 1, all of them at tp 2)."""
    batches = sorted({r.batch for r in profile.decode})
    rows: dict[str, float] = {}
    for tp in (1, 2):
        for b in (batches[0], batches[-1]):
            cells = [r for r in profile.decode if r.tp == tp and r.batch == b]
            rows[f"tp{tp}_b{b}_s"] = min(cells, key=lambda r: r.context_tokens).seconds
    lm = LatencyModel.fit(profile)
    big = -(-rollout_batch // 2)

    def step(tp: int, b: int) -> float:
        return float(lm.step_time(tp, b, b * ctx))

    small_tp2 = step(2, 1) < step(1, 1)
    big_dp = step(1, big) < step(2, 2 * big)
    ceiling = adaptive_ceiling(lm, Layout(2, 1), Layout(1, 2), rollout_batch, ctx)
    return {
        "measured": rows,
        "model": {
            "tp1_b1_s": step(1, 1),
            "tp2_b1_s": step(2, 1),
            f"tp1_b{big}_s (dp2 x {big})": step(1, big),
            f"tp2_b{2 * big}_s (dp1 x {2 * big})": step(2, 2 * big),
            "context_per_seq": ctx,
        },
        "crossover": bool(small_tp2 and big_dp),
        "tp2_faster_at_batch_1": bool(small_tp2),
        "dp2_faster_at_largest_batch": bool(big_dp),
        # the least adaptive / best static any workload of at most rollout_batch sequences
        # allows, switching for free (patrl.lenpredict.ceiling)
        "ceiling": dataclasses.asdict(ceiling),
    }


def profiled_with(path: Path, scale: Scale) -> bool:
    """Whether `path` holds a profile of these grids (`profile_shape` notes them)."""
    if not path.is_file():
        return False
    return Profile.load(path).notes.get("grid") == grids_note(scale)
