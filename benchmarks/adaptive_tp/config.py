"""The bench's fixed names and targets, and `BenchConfig`, the settings of one invocation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .shapes import Scale

BENCHMARKS = Path(__file__).resolve().parents[1]
RESULTS = BENCHMARKS / "results"
ENTRY = BENCHMARKS / "adaptive_tp_bench.py"  # the script torchrun starts on every rank

POLICIES = (
    "static_dp2_tp1",
    "static_dp1_tp2",
    "adaptive_predicted",
    "adaptive_oracle",
    "adaptive_cold",
)
ADAPTIVE = POLICIES[2:]
STATIC = POLICIES[:2]
MARGIN = 0.2  # the planner's required margin of gain over overhead
TARGET_LONG_TAIL = 0.85  # adaptive / best static on long-tail, shape with a crossover
TARGET_ELSEWHERE = 1.03
TARGET_CONTROL = 0.02  # control time / decode time


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What one invocation runs: `check_every` decode steps between planner checks for shapes
    that do not set their own, `repeats` (at least; a shape may ask more), `quick` (the tiny
    shape and workloads), and where results go."""

    check_every: int
    repeats: int = 3
    margin: float = MARGIN
    quick: bool = False
    profile_only: bool = False
    reuse_profile: bool = False
    results: Path = RESULTS

    @property
    def suffix(self) -> str:
        """Appended to every file name a run writes, so a quick run never overwrites a full one."""
        return "_quick" if self.quick else ""

    def check_every_for(self, scale: Scale) -> int:
        return scale.check_every or self.check_every
