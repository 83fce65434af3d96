"""What adaptive-TP control records: every decision with its prediction and, once the rollout
ended, its measured outcome; and what control cost the rollouts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from patrl.lenpredict import Decision


@dataclass(slots=True)
class TPDecisionRecord:
    """One planner check, with its prediction and, once the rollout ended, what happened."""

    t: float  # seconds since the rollout started, when the decision arrived (this rank's clock)
    action: str  # "stay" | "switch"
    current_tp: int
    target_tp: int
    num_seqs: int
    predicted_gain_s: float  # time saved by the best switch, before its overhead
    predicted_overhead_s: float
    # to the end of the rollout along the chosen path, overhead included (None: no length
    # was predicted, as no switch could pay even with every sequence at its max_tokens)
    predicted_finish_s: float | None
    reason: str
    num_migrated: int = 0
    num_recomputed: int = 0
    measured_overhead_s: float | None = None  # the reconfigure, as this rank timed it
    measured_finish_s: float | None = None  # from the check to the end of the rollout

    def to_dict(self) -> dict[str, Any]:
        """The record as plain values (for JSON metrics)."""
        return asdict(self)


@dataclass(slots=True)
class ControlStats:
    checks: int = 0
    switches: int = 0
    control_s: float = 0.0  # checks made with work pending: summary, planner, broadcast
    # What control cost the rollouts, summed (see `critical_path`): each rollout's time less
    # its switches and its busiest rank's decode time; the same on every rank.
    critical_control_s: float = 0.0
    planner_s: float = 0.0  # rank 0's planner calls (RunningSet building included)
    reconfig_s: float = 0.0
    reset_s: float = 0.0  # returning to the starting layout after a rollout
    decode_s: float = 0.0  # time in Engine.step during adaptive rollouts
    critical_decode_s: float = 0.0  # per rollout, the busiest rank's decode_s, summed

    def as_dict(self) -> dict[str, float]:
        return {f"tp_{k}": float(getattr(self, k)) for k in self.__slots__}


def critical_path(ranks: list[tuple[float, float]]) -> tuple[float, float]:
    """(control, decode) seconds of a rollout on its critical path, from each rank's (decode
    time, wall time less its switches): the busiest rank's decode time is the rollout with no
    checks; the rest of the least wall time is what control cost (the checks and the waits
    they impose, as every check synchronises the replicas)."""
    decode = max(d for d, _ in ranks)
    return max(0.0, min(w for _, w in ranks) - decode), decode


def record_of(decision: Decision, t: float) -> TPDecisionRecord:
    """The record of `decision`, arrived `t` seconds into the rollout."""
    chosen = decision.chosen
    finish = chosen.run_s + (chosen.overhead_s if decision.action == "switch" else 0.0)
    return TPDecisionRecord(
        t=t,
        action=decision.action,
        current_tp=decision.current.tp,
        target_tp=decision.target.tp,
        num_seqs=len(decision.seq_ids),
        predicted_gain_s=float(decision.gain_s),
        predicted_overhead_s=float(decision.overhead_s),
        predicted_finish_s=float(finish),
        reason=decision.reason,
    )
