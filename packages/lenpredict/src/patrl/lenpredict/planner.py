"""The reconfiguration planner: stay, or switch the rollout to another (dp, tp) layout now?

For each option the planner predicts the time to finish every unfinished sequence. A replica's
time is a sum over the segments between consecutive predicted finishes: while `alive`
sequences remain, each step costs `step_time(tp, alive, context)`, and the context grows by
one token per alive sequence per step (the model is linear in context, so the segment's mean
context gives its exact sum). The layout's time is its slowest replica; each remaining-length
quantile is one scenario and the scenarios are averaged.

A switch costs a barrier, the weight reshard, and per sequence either migrating its KV heads
or recomputing its KV by prefill, whichever the latency model says is cheaper. The planner
switches only when the predicted gain exceeds that overhead by a margin, waits `cooldown_calls`
after a switch, and within one rollout moves TP in one direction only, so it cannot oscillate.
Every decision is kept as a record with its predictions, for the log and for audit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from patrl.lenpredict.latency_model import LatencyModel
from patrl.lenpredict.layout import Layout, layouts_for, nested


class PlannerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    candidate_tp: tuple[int, ...] = (1, 2, 4, 8)
    # switch only when gain > overhead · (1 + margin) + min_gain_s
    margin: float = Field(default=0.2, ge=0)
    min_gain_s: float = Field(default=0.0, ge=0)
    cooldown_calls: int = Field(default=1, ge=0)
    memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # the engine's per-replica cap: a layout whose replicas would hold more sequences than this
    # cannot run them all at once, so the finish-time model above would flatter it
    max_num_seqs: int = Field(default=256, gt=0)


@dataclass(slots=True)
class RunningSet:
    """The unfinished sequences, as parallel arrays (one row per sequence)."""

    seq_ids: np.ndarray  # int
    replica: np.ndarray  # int, replica of the current layout holding the sequence
    context: np.ndarray  # int, prompt + generated tokens
    remaining: np.ndarray  # float (n, Q), predicted remaining-length quantiles

    def __post_init__(self) -> None:
        n = len(self.seq_ids)
        if self.remaining.ndim != 2 or self.remaining.shape[0] != n:
            raise ValueError(f"remaining must have shape ({n}, Q), got {self.remaining.shape}")
        if len(self.replica) != n or len(self.context) != n:
            raise ValueError(
                f"seq_ids/replica/context lengths differ: {n}/{len(self.replica)}/{len(self.context)}"
            )

    def __len__(self) -> int:
        return len(self.seq_ids)


@dataclass(slots=True)
class Option:
    layout: Layout
    run_s: float  # predicted time to finish in this layout, after the switch
    overhead_s: float  # predicted cost of switching to it (0 for the current layout)
    assignment: np.ndarray  # replica of each sequence in this layout
    migrate: np.ndarray  # bool per sequence: migrate its KV (True) or recompute it (False)


@dataclass(slots=True)
class Decision:
    action: Literal["stay", "switch"]
    current: Layout
    target: Layout
    gain_s: float  # predicted time saved by the best switch, before its overhead
    overhead_s: float
    reason: str
    options: list[Option]
    seq_ids: np.ndarray

    @property
    def chosen(self) -> Option:
        return next(o for o in self.options if o.layout == self.target)

    def record(self) -> dict[str, Any]:
        """JSON-serialisable summary for the metrics log."""
        chosen = self.chosen
        return {
            "action": self.action,
            "current": str(self.current),
            "target": str(self.target),
            "gain_s": self.gain_s,
            "overhead_s": self.overhead_s,
            "reason": self.reason,
            "num_seqs": len(self.seq_ids),
            "predicted": {
                str(o.layout): {"run_s": o.run_s, "overhead_s": o.overhead_s} for o in self.options
            },
            "migrate": int(chosen.migrate.sum()),
            "recompute": int((~chosen.migrate).sum()) if self.action == "switch" else 0,
        }


class ReconfigPlanner:
    def __init__(self, latency: LatencyModel, world_size: int, config: PlannerConfig | None = None):
        self.latency = latency
        self.world_size = world_size
        self.config = config or PlannerConfig()
        missing = [tp for tp in self.config.candidate_tp if tp not in latency.tp_sizes]
        if missing:
            raise ValueError(
                f"candidate tp {missing} not in the latency model's {latency.tp_sizes}"
            )
        self.candidates = layouts_for(world_size, list(self.config.candidate_tp))
        self.decisions: list[Decision] = []
        self._direction = 0
        self._since_switch = self.config.cooldown_calls

    def new_rollout(self) -> None:
        """A new batch starts: the direction lock and cooldown of the last one no longer apply."""
        self._direction = 0
        self._since_switch = self.config.cooldown_calls

    # --- prediction ---------------------------------------------------------------------

    def finish_time(
        self,
        tp: int,
        num_replicas: int,
        replica: np.ndarray,
        context: np.ndarray,
        remaining: np.ndarray,
    ) -> float:
        """Predicted seconds until every sequence has finished, averaged over the quantile
        scenarios (see the module docstring)."""
        n, q = remaining.shape
        if n == 0:
            return 0.0
        key = (np.arange(q)[:, None] * num_replicas + replica[None, :]).ravel()
        rem = remaining.T.ravel()
        # one sort by (scenario, replica, remaining): the key dominates, rem breaks ties
        order = np.argsort(key * (rem.max() + 1.0) + rem)
        key, rem = key[order], rem[order]
        prefix = np.zeros(key.size + 1)
        np.cumsum(context[order % n], out=prefix[1:])
        counts = np.bincount(key, minlength=q * num_replicas)
        ends = np.cumsum(counts)
        end = ends[key]
        here = np.arange(key.size)
        alive = end - here
        prev = np.empty(key.size)
        prev[0] = 0.0
        prev[1:] = rem[:-1]
        prev[(ends - counts)[counts > 0]] = 0.0  # each group starts from now
        context_mid = prefix[end] - prefix[here] + alive * (prev + rem - 1) / 2
        seconds = (rem - prev) * self.latency.step_time(tp, alive, np.maximum(context_mid, 0))
        per_replica = np.bincount(key, weights=seconds, minlength=q * num_replicas)
        return float(per_replica.reshape(q, num_replicas).max(axis=1).mean())

    def _assign(self, running: RunningSet, src: Layout, dst: Layout) -> np.ndarray:
        """Growing TP merges whole replicas (sequences stay on the ranks that hold them);
        shrinking splits each replica's sequences over its children, longest first."""
        if dst.tp >= src.tp:
            return running.replica // (dst.tp // src.tp)
        # longest first in snake order (0,1,..,s-1,s-1,..,0): a vectorised near-LPT split
        split = src.tp // dst.tp
        work = running.remaining.mean(axis=1)
        order = np.argsort(running.replica * (work.max() + 1.0) - work)
        replica = running.replica[order]
        starts = np.flatnonzero(np.r_[True, replica[1:] != replica[:-1]])
        rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
        lap = rank % (2 * split)
        child = np.empty(len(order), dtype=int)
        child[order] = np.where(lap < split, lap, 2 * split - 1 - lap)
        return running.replica * split + child

    def switch_overhead(
        self, running: RunningSet, src: Layout, dst: Layout, assignment: np.ndarray
    ) -> tuple[float, np.ndarray]:
        """Predicted seconds of a switch and, per sequence, whether its KV is migrated."""
        lat = self.latency
        lo, hi = sorted((src.tp, dst.tp))
        moved = lat.kv_bytes(running.context) * (1 - lo / hi)
        # the moved heads land on `hi` ranks at once, each over its own link
        migrate_cost = lat.send_marginal(moved) / hi
        recompute_cost = lat.prefill_marginal(dst.tp, running.context)
        migrate = migrate_cost <= recompute_cost
        per_seq = np.where(migrate, migrate_cost, recompute_cost)
        kv: np.ndarray = np.bincount(assignment, weights=per_seq, minlength=dst.dp)
        migrates = np.bincount(assignment, weights=migrate, minlength=dst.dp) > 0
        recomputes = np.bincount(assignment, weights=~migrate, minlength=dst.dp) > 0
        kv = kv + migrates * lat.send_fixed() + recomputes * lat.prefill_fixed(dst.tp)
        fixed = lat.switch_fixed_time(self.world_size) + lat.weight_reshard_time(src.tp, dst.tp)
        return fixed + float(kv.max(initial=0.0)), migrate

    def _fits(self, running: RunningSet, layout: Layout, assignment: np.ndarray) -> bool:
        """Every replica can hold its sequences: count within max_num_seqs, KV within memory."""
        if np.bincount(assignment, minlength=layout.dp).max() > self.config.max_num_seqs:
            return False
        capacity = self.latency.kv_capacity_tokens(layout.tp, self.config.memory_utilization)
        used = np.bincount(assignment, weights=running.context, minlength=layout.dp)
        return bool((used <= capacity).all())

    # --- decision -----------------------------------------------------------------------

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        """Stay or switch, with the predicted time of every option considered."""
        n = len(running)
        stay = Option(
            layout=current,
            run_s=self.finish_time(
                current.tp, current.dp, running.replica, running.context, running.remaining
            ),
            overhead_s=0.0,
            assignment=running.replica,
            migrate=np.zeros(n, dtype=bool),
        )
        options = [stay]
        for layout in self.candidates:
            if layout == current or not nested(layout, current):
                continue
            direction = int(np.sign(layout.tp - current.tp))
            if self._direction and direction != self._direction:
                continue
            assignment = self._assign(running, current, layout)
            if not self._fits(running, layout, assignment):
                continue
            overhead, migrate = self.switch_overhead(running, current, layout, assignment)
            run = self.finish_time(
                layout.tp, layout.dp, assignment, running.context, running.remaining
            )
            options.append(Option(layout, run, overhead, assignment, migrate))
        decision = self._choose(options, current, running.seq_ids)
        self.decisions.append(decision)
        return decision

    def _choose(self, options: list[Option], current: Layout, seq_ids: np.ndarray) -> Decision:
        stay, switches = options[0], options[1:]
        self._since_switch += 1
        if not switches:
            return Decision(
                "stay", current, current, 0.0, 0.0, "no admissible layout", options, seq_ids
            )
        best = min(switches, key=lambda o: o.run_s + o.overhead_s)
        gain = stay.run_s - best.run_s
        need = best.overhead_s * (1 + self.config.margin) + self.config.min_gain_s
        if self._since_switch <= self.config.cooldown_calls:
            reason = f"cooldown: {self._since_switch} of {self.config.cooldown_calls} calls since the last switch"
            return Decision(
                "stay", current, current, gain, best.overhead_s, reason, options, seq_ids
            )
        if gain <= need:
            reason = f"best {best.layout}: gain {gain:.4g}s <= needed {need:.4g}s"
            return Decision(
                "stay", current, current, gain, best.overhead_s, reason, options, seq_ids
            )
        self._direction = int(np.sign(best.layout.tp - current.tp))
        self._since_switch = 0
        reason = f"gain {gain:.4g}s > needed {need:.4g}s"
        return Decision(
            "switch", current, best.layout, gain, best.overhead_s, reason, options, seq_ids
        )
