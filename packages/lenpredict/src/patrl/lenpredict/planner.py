"""The reconfiguration planner: stay, or switch the rollout to another (dp, tp) layout now?

It prices staying, switching now, and switching to the same target after a few steps (when
given fractions of the sequences are predicted done), each remaining-length quantile one
scenario (plans.py, pricing.py). It switches when the predicted gain over staying exceeds the
overhead by the margin, no delayed switch to that target is better, the cooldown has passed,
and TP keeps the rollout's direction (it only grows or only shrinks), so it cannot oscillate.
At a rollout's first call a split sets no direction and is also priced as a round trip (split
now, fold back later). Every decision is kept with its predictions, for audit.
See docs/adaptive_tp.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from patrl.lenpredict.finish_time import RunningSet, independent_draws
from patrl.lenpredict.latency_model import LatencyModel
from patrl.lenpredict.layout import Layout, layouts_for, nested
from patrl.lenpredict.plans import Option, assign_replicas, delay_steps, plan_questions
from patrl.lenpredict.pricing import PlanPricer
from patrl.lenpredict.speculation import SpeculativeTail

__all__ = ["NEVER", "Decision", "Option", "PlannerConfig", "ReconfigPlanner"]

# `Decision.recheck_steps` when nothing can change the decision before the rollout ends
NEVER = 1 << 62


class PlannerConfig(BaseModel):
    """The planner's knobs: candidate TP sizes, the margin a switch must clear, pacing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    candidate_tp: tuple[int, ...] = (1, 2, 4, 8)
    # switch only when gain > overhead · (1 + margin) + min_gain_s
    margin: float = Field(default=0.2, ge=0)
    min_gain_s: float = Field(default=0.0, ge=0)
    cooldown_calls: int = Field(default=1, ge=0)
    # fractions of the running sequences predicted finished at which a delayed switch is priced
    delay_levels: tuple[float, ...] = (0.5, 0.9)
    memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # the engine's per-replica cap: a layout whose replicas would hold more sequences cannot
    # run them all at once, so the time model would flatter it
    max_num_seqs: int = Field(default=256, gt=0)
    history: int = Field(default=1024, gt=0)  # decisions kept for audit
    # How a layout's finish time is averaged over what the lengths may be. "quantiles": one
    # scenario per column of the running set's remaining-length quantiles, every sequence at
    # the same quantile at once (comonotone). "independent": `draws` Monte Carlo scenarios,
    # each sequence's length drawn on its own from its quantiles (`independent_draws`), so a
    # replica's finish is the longest of independent samples, as in a real rollout.
    finish_time: Literal["quantiles", "independent"] = "quantiles"
    # the quantile levels of the running set's columns (the LengthPredictor's `quantiles`)
    quantile_levels: tuple[float, ...] = (0.1, 0.5, 0.9)
    draws: int = Field(default=16, gt=0)
    seed: int = 0


@dataclass(slots=True)
class Decision:
    """What the planner decided, why, and every option it priced (`record()` for the log)."""

    action: Literal["stay", "switch"]
    current: Layout
    target: Layout
    gain_s: float  # predicted time saved by the best switch now, before its overhead
    overhead_s: float
    reason: str
    options: list[Option]
    seq_ids: np.ndarray
    # ask again after this many decode steps, when a delayed switch is the plan (None: the
    # caller's usual interval)
    recheck_steps: int | None = None
    # a stay's decode steps during which no target can run a step faster than `current`, even
    # if the sequences finish at their lowest predicted quantile (`PlanPricer.quiet_steps`):
    # the caller need not ask again before then
    quiet_steps: int = 0

    @property
    def chosen(self) -> Option:
        return next(o for o in self.options if o.layout == self.target)

    def record(self) -> dict[str, Any]:
        """JSON-serialisable summary for the metrics log (no inf: None where nothing applies)."""
        switching = self.action == "switch"
        return {
            "action": self.action,
            "current": str(self.current),
            "target": str(self.target),
            "gain_s": self.gain_s,
            "overhead_s": self.overhead_s,
            "reason": self.reason,
            "num_seqs": len(self.seq_ids),
            "predicted": {
                str(o.layout): {
                    "run_s": o.run_s,
                    "overhead_s": o.overhead_s if np.isfinite(o.overhead_s) else None,
                    "later_s": o.later_s if np.isfinite(o.later_s) else None,
                    "later_steps": o.later_steps,
                    "round_trip_s": o.round_trip_s if np.isfinite(o.round_trip_s) else None,
                    "round_trip_steps": o.round_trip_steps,
                }
                for o in self.options
            },
            "migrate": int(self.chosen.migrate.sum()) if switching else 0,
            "recompute": int((~self.chosen.migrate).sum()) if switching else 0,
            "recheck_steps": self.recheck_steps,
            "quiet_steps": self.quiet_steps,
        }


class ReconfigPlanner:
    """Decides stay or switch for the running set of one rollout (`decide`), and answers the
    cheaper questions a caller asks between decisions (`may_switch`, `shrinking_share`).

    `speculation`: the tail's speed when the rollout speculates (`SpeculativeTail`, e.g. from
    the run's logged `rollout/spec_acceptance` and `rollout/spec_tokens_per_step`): every
    price is then of the steps as they run, the small ones speculating; None (or a tail of
    one token a step) prices them as plain decode steps."""

    def __init__(
        self,
        latency: LatencyModel,
        world_size: int,
        config: PlannerConfig | None = None,
        speculation: SpeculativeTail | None = None,
    ):
        self.latency = latency
        self.world_size = world_size
        self.config = config or PlannerConfig()
        missing = [tp for tp in self.config.candidate_tp if tp not in latency.tp_sizes]
        if missing:
            raise ValueError(
                f"candidate tp {missing} not in the latency model's {latency.tp_sizes}"
            )
        self.candidates = layouts_for(world_size, list(self.config.candidate_tp))
        self.decisions: deque[Decision] = deque(maxlen=self.config.history)
        self.pricer = PlanPricer(
            latency,
            world_size,
            self.config.candidate_tp,
            memory_utilization=self.config.memory_utilization,
            max_num_seqs=self.config.max_num_seqs,
            speculation=speculation,
        )
        self._direction = 0
        self._since_switch = self.config.cooldown_calls
        self._calls = 0  # decide() calls in this rollout
        self._draws = 0  # independent draws made (the seed of the next), over all rollouts

    @property
    def speculation(self) -> SpeculativeTail | None:
        return self.pricer.speculation

    def set_speculation(self, speculation: SpeculativeTail | None) -> None:
        """Price the tail at this speed from the next question on (e.g. each rollout, as the
        run's measured acceptance moves)."""
        self.pricer.set_speculation(speculation)

    def new_rollout(self) -> None:
        """A new batch starts: the direction lock and cooldown of the last one no longer apply."""
        self._direction = 0
        self._since_switch = self.config.cooldown_calls
        self._calls = 0

    # --- questions between decisions ----------------------------------------------------

    def finish_time(
        self, tp: int, num_replicas: int, replica: np.ndarray, running: RunningSet
    ) -> float:
        """Predicted seconds until every sequence has finished in this layout, from now."""
        return self.pricer.finish_time(tp, num_replicas, replica, running)

    def shrinking_share(self, running: RunningSet, current: Layout, steps: int) -> float:
        """`PlanPricer.shrinking_share`: a check `steps` away is that much nearer in time than
        the batch's pace says."""
        return self.pricer.shrinking_share(running, current, steps)

    def switch_overhead(
        self, running: RunningSet, src: Layout, dst: Layout, assignment: np.ndarray
    ) -> tuple[float, np.ndarray]:
        """Predicted seconds of switching now, and per sequence whether its KV is migrated."""
        return self.pricer.switch_overhead(running, src, dst, assignment)

    def never_switches_from(self, current: Layout, max_context: int) -> bool:
        """True when no rollout opened at `current` can ever switch: no candidate is faster at
        any batch a replica can hold (max_num_seqs) with sequences of 1 to `max_context`
        tokens. Every rank answers alike from the same profile, so an engine can skip its
        checks without asking the others."""
        n = self.config.max_num_seqs
        targets = [t for t in self.candidates if t != current and nested(t, current)]
        contexts = (1.0, float(max_context))
        return all(self.pricer.no_faster_step(current, t, n, contexts) for t in targets)

    def may_switch(self, running: RunningSet, current: Layout) -> bool:
        """Whether a switch from `current` could pay before the rollout ends with no sequence
        running longer than `running.remaining.max()` more tokens. Given every sequence's hard
        bound (its max_tokens), False spares the caller predicting the lengths."""
        return any(
            not self.pricer.never_pays(current, t, running) for t in self._admissible(current)
        )

    # --- the decision -------------------------------------------------------------------

    def _admissible(self, current: Layout) -> list[Layout]:
        result = []
        for layout in self.candidates:
            if layout == current or not nested(layout, current):
                continue
            if self._direction and (layout.tp > current.tp) != (self._direction > 0):
                continue
            result.append(layout)
        return result

    def scenarios(self, running: RunningSet) -> tuple[RunningSet, np.ndarray, int]:
        """The running set with the remaining-length columns `decide` prices, the weight of
        each column in a mean (summing to 1) and the median column (weight 0 under
        "independent": it only places the delayed switches)."""
        q = running.remaining.shape[1]
        median = q // 2
        if self.config.finish_time == "quantiles" or q == 1:
            return running, np.full(q, 1 / q), median
        levels = np.asarray(self.config.quantile_levels, dtype=float)
        if len(levels) != q:
            raise ValueError(
                f"finish_time='independent' needs quantile_levels for the {q} columns of the "
                f"running set's remaining lengths; got {levels.tolist()}"
            )
        self._draws += 1
        rng = np.random.default_rng([self.config.seed, self._draws])
        draws = independent_draws(
            running.remaining, levels, self.config.draws, rng, running.max_remaining
        )
        columns = np.concatenate([draws, running.remaining[:, median : median + 1]], axis=1)
        weights = np.r_[np.full(self.config.draws, 1 / self.config.draws), 0.0]
        return replace(running, remaining=columns), weights, self.config.draws

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        """Stay or switch, with the predicted time of every option considered.

        Staying and switching now are priced in every scenario (`scenarios`); each delayed
        switch in the median one, carried over to all as switching now is. All of it in one
        vectorised pass of finish times and one of overheads."""
        n = len(running)
        if n == 0:
            raise ValueError("decide() needs at least one unfinished sequence")
        self._calls += 1
        priced, weights, med = self.scenarios(running)
        q = len(weights)
        admissible = self._admissible(current)
        targets = [t for t in admissible if not self.pricer.never_pays(current, t, running)]
        if admissible and not targets:
            return self._stay_for_good(running, current, admissible)
        assignments = [assign_replicas(running, current, t) for t in targets]
        median = priced.remaining[:, med]
        delays = delay_steps(median, self.config.delay_levels) if targets else np.zeros(0)
        # At a rollout's first call a split may pay only with a fold back for the tail (it
        # opened at a TP that suits the tail, where this batch's bulk runs faster on more
        # replicas): "split now, fold back after `delay` steps", median scenario.
        trips = [j for j, t in enumerate(targets) if t.tp < current.tp] if self._calls == 1 else []
        rows = plan_questions(current, targets, q, delays, trips, med)
        times = self.pricer.times(rows, np.stack([running.replica, *assignments]), priced)
        m, k = len(targets), len(delays)
        split = (m + 1) * q
        now = times[:split].reshape(m + 1, q)
        never = np.zeros(n, dtype=bool)
        options = [Option(current, float(now[0] @ weights), 0.0, np.inf, 0, running.replica, never)]
        if targets:
            # row 0 switches now, row 1 + i after delays[i] steps (median scenario)
            steps = np.r_[0.0, delays][:, None]
            context = running.context[None, :] + np.minimum(median[None, :], steps)
            alive = (median[None, :] > steps) | (steps == 0)
            overheads, migrate = self.pricer.overheads(
                current, targets, assignments, context, alive, running.holds_kv, running.shared
            )
            before = times[split : split + k]
            after = times[split + k : split + k + m * k].reshape(m, k)
            options += _switch_options(
                targets, assignments, now, before, after, overheads, migrate, delays, weights, med
            )
            if trips and k:
                trip_rows = times[split + k + m * k :]
                self._price_round_trips(
                    options, trips, trip_rows, delays, context[1:], alive[1:], now, weights, med
                )
        decision = self._choose(options, current, running.seq_ids)
        if decision.action == "stay" and decision.recheck_steps is None and targets:
            decision.quiet_steps = self.pricer.quiet_steps(running, current, targets, assignments)
        self.decisions.append(decision)
        return decision

    def _stay_for_good(
        self, running: RunningSet, current: Layout, admissible: list[Layout]
    ) -> Decision:
        """No admissible switch can pay before the rollout ends: stay, and ask not to be
        called again (`recheck_steps=NEVER`)."""
        n = len(running)
        stay = Option(
            current,
            self.finish_time(current.tp, current.dp, running.replica, running),
            0.0,
            np.inf,
            0,
            running.replica,
            np.zeros(n, dtype=bool),
        )
        self._since_switch += 1
        decision = Decision(
            "stay",
            current,
            current,
            0.0,
            0.0,
            f"no switch can pay: {', '.join(map(str, admissible))} no faster than "
            f"{current} at any batch of <= {n} sequences",
            [stay],
            running.seq_ids,
            recheck_steps=NEVER,
        )
        self.decisions.append(decision)
        return decision

    def _price_round_trips(
        self,
        options: list[Option],
        trips: list[int],
        rows: np.ndarray,
        delays: np.ndarray,
        context: np.ndarray,
        alive: np.ndarray,
        now: np.ndarray,
        weights: np.ndarray,
        med: int,
    ) -> None:
        """Fill `round_trip_s` of the split options `trips` (indices into the targets) from
        their rows: per split, its steps before each delay, then the current layout's steps
        after each delay (shared by all splits); plus the split's overhead now and the fold
        back's at each delay (its sequences all hold KV by then). Carried from the median
        scenario to all as staying is (the plan ends in the current layout)."""
        current = options[0]
        k = len(delays)
        before, after = rows[: len(trips) * k].reshape(len(trips), k), rows[len(trips) * k :]
        holds = np.ones(context.shape[1], dtype=bool)
        for i, j in enumerate(trips):
            split = options[j + 1]
            back, _ = self.pricer.overheads(
                split.layout, [current.layout], [current.assignment], context, alive, holds
            )
            total = split.overhead_s + before[i] + back[0] + after
            best = int(np.argmin(total))
            split.round_trip_s = float(total[best] + now[0] @ weights - now[0, med])
            split.round_trip_steps = int(delays[best])

    def _choose(self, options: list[Option], current: Layout, seq_ids: np.ndarray) -> Decision:
        stay, switches = options[0], options[1:]
        self._since_switch += 1
        feasible = [o for o in switches if np.isfinite(o.now_s)]
        if not feasible:
            return Decision(
                "stay", current, current, 0.0, 0.0, "no admissible layout", options, seq_ids
            )
        best = min(feasible, key=lambda o: o.now_s)
        gain = stay.run_s - best.run_s
        trip = min(feasible, key=lambda o: o.round_trip_s)
        round_trip = trip.round_trip_s < min(best.now_s, stay.run_s)
        if round_trip:
            # split now and fold back later: the fold back's overhead is part of the plan's
            # run, the split's is the overhead the margin applies to
            best, gain = trip, stay.run_s - (trip.round_trip_s - trip.overhead_s)
        need = best.overhead_s * (1 + self.config.margin) + self.config.min_gain_s

        def stay_because(reason: str) -> Decision:
            return Decision(
                "stay", current, current, gain, best.overhead_s, reason, options, seq_ids
            )

        if self._since_switch <= self.config.cooldown_calls:
            return stay_because(
                f"cooldown: {self._since_switch} of {self.config.cooldown_calls} calls"
            )
        if gain <= need:
            return stay_because(f"best {best.layout}: gain {gain:.4g}s <= needed {need:.4g}s")
        if best.later_s < best.now_s and not round_trip:
            # only the same target is compared: switching now does not rule out a further
            # switch later, which a one-switch plan to another target cannot see
            decision = stay_because(
                f"switching to {best.layout} after {best.later_steps} steps "
                f"({best.later_s:.4g}s) beats switching now ({best.now_s:.4g}s)"
            )
            decision.recheck_steps = best.later_steps
            return decision
        # A split at the rollout's first call, before anything was decoded, re-chooses where
        # it opens (it opened where an earlier batch was best): it locks no direction, so
        # the tail may still fold into larger TP groups.
        reopen = self._calls == 1 and best.layout.tp < current.tp
        self._direction = 0 if reopen else int(np.sign(best.layout.tp - current.tp))
        self._since_switch = 0
        reason = f"gain {gain:.4g}s > needed {need:.4g}s"
        if round_trip:
            reason += f" (split now, fold back to {current} after {best.round_trip_steps} steps)"
        return Decision(
            "switch", current, best.layout, gain, best.overhead_s, reason, options, seq_ids
        )


def _switch_options(
    targets: list[Layout],
    assignments: list[np.ndarray],
    now: np.ndarray,
    before: np.ndarray,
    after: np.ndarray,
    overheads: np.ndarray,
    migrate: np.ndarray,
    delays: np.ndarray,
    weights: np.ndarray,
    med: int,
) -> list[Option]:
    """One option per target from its priced rows: run and overhead of switching now (the
    scenarios' weighted mean), and its best delayed switch (median column, carried over to
    all as switching now is)."""
    m, k = len(targets), len(delays)
    run = now[1:] @ weights
    later_s, later_steps = np.full(m, np.inf), np.zeros(m, dtype=int)
    if k:
        later = before + overheads[:, 1:] + after  # (targets, delays), median scenario
        best = np.argmin(later, axis=1)
        later_s = later[np.arange(m), best] + run - now[1:, med]
        later_steps = delays[best].astype(int)
    return [
        Option(
            targets[j], float(run[j]), float(overheads[j, 0]), float(later_s[j]),
            int(later_steps[j]), assignments[j], migrate[j, 0],
        )
        for j in range(m)
    ]  # fmt: skip
