"""The reconfiguration planner: stay, or switch the rollout to another (dp, tp) layout now?

Time model (finish_time.py): per layout, the time until the slowest replica has finished its
sequences; each remaining-length quantile is one scenario and scenarios are averaged.

Plans. Besides staying and switching now, the planner prices "stay s more steps, then switch
to the same target" for a few s (by default when half and when 90% of the sequences are
predicted done), because PAT picks the reconfiguration *point* as well as the target: a switch
that pays off now may pay off more later, once more sequences have finished. Every target's
delayed switches are priced (`Option.later_s`), but a switch now is weighed only against
delaying the same target, since switching now does not rule out a further switch later. It
switches when the predicted gain of switching now over staying exceeds the overhead by the
margin, no delayed switch to that target is predicted better, the cooldown has passed, and the
target continues the rollout's direction (TP only grows or only shrinks within one rollout),
so it cannot oscillate. A split at a rollout's first call, before anything was decoded, sets
no direction: it corrects where the rollout opened, and the tail may still fold later. So at
that call a split is also priced as a round trip, "split now, fold back to the current layout
after s steps" (`Option.round_trip_s`): a rollout that opened at a TP that suits its tail, where
its bulk runs faster on more replicas, would otherwise compare staying only with splitting for
good, and stay.

Overhead. A barrier, the weight reshard, and per sequence either migrating the KV heads it
must move or recomputing its KV by prefill, whichever the latency model prices lower.

Shortcut. When the latency model says no admissible target is faster than the current layout
at any batch size the shrinking running set can still have, no switch can pay before the
rollout ends: the planner stays without pricing anything and asks not to be called again
(`recheck_steps=NEVER`), which spares the engine its checks on a shape where TP never helps.

Every decision is kept as a record with the predictions it was made from, for audit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from patrl.lenpredict.finish_time import Questions, RunningSet, slowest_replica_times
from patrl.lenpredict.latency_model import LatencyModel
from patrl.lenpredict.layout import Layout, layouts_for, nested

# `Decision.recheck_steps` when nothing can change the decision before the rollout ends
NEVER = 1 << 62


class PlannerConfig(BaseModel):
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


@dataclass(slots=True)
class Option:
    layout: Layout
    run_s: float  # predicted time to finish in this layout after switching now
    overhead_s: float  # predicted cost of switching to it now (0 for the current layout)
    later_s: float  # best predicted total when switching to it after some steps (inf: none)
    later_steps: int  # after how many steps that best delayed switch happens
    assignment: np.ndarray  # replica of each sequence in this layout
    migrate: np.ndarray  # bool per sequence: migrate its KV (True) or recompute it (False)
    # a split at the rollout's first call: the best predicted total when splitting now and
    # folding back to the current layout after `round_trip_steps` steps, both switches'
    # overheads included (inf: not priced)
    round_trip_s: float = np.inf
    round_trip_steps: int = 0

    @property
    def now_s(self) -> float:
        return self.run_s + self.overhead_s


@dataclass(slots=True)
class Decision:
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
    # if the sequences finish at their lowest predicted quantile (`ReconfigPlanner._quiet`):
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


@dataclass(frozen=True, slots=True)
class _SwitchCosts:
    """What pricing the switches from one TP size to some targets, in rows of scenarios,
    needs besides the sequences: per target (targets, 1, 1) and per replica slot (the slots
    of target j, row r start at `group_start[j, r]`, one per replica)."""

    migrate_per_token: np.ndarray  # seconds to move one token's KV heads that change rank
    # (targets, 1, 1) each: a recompute's seconds per sequence, per token and per token²
    prefill_s: np.ndarray
    prefill_b: np.ndarray
    prefill_c: np.ndarray
    fixed: np.ndarray  # (targets, 1): barrier + weight reshard
    per_seq: np.ndarray  # (targets, 1): what each sequence in flight adds
    per_token: np.ndarray  # (targets, 1): what each context token in flight adds
    group_start: np.ndarray  # (targets, rows)
    size: int  # slots in all
    sum_start: np.ndarray  # (5, targets, rows, 1): group_start of each of five sums
    send_alpha: float
    prefill_a: np.ndarray  # (size,)
    capacity: np.ndarray  # (size,) KV tokens a replica holds

    @classmethod
    def build(
        cls, planner: ReconfigPlanner, src: int, targets: tuple[int, ...], rows: int
    ) -> _SwitchCosts:
        world = planner.world_size
        dp = np.array([world // t for t in targets])
        latency = planner.latency
        send_alpha = planner._send_coef[0]
        migrate = np.array([latency.switch_migrate_per_token(src, t) for t in targets])
        prefill = np.array([planner._prefill_coef[t] for t in targets])
        slots = np.repeat(dp, rows)
        start = np.r_[0, np.cumsum(slots)[:-1]].reshape(len(targets), rows)
        capacity = [planner._capacity[t] for t in targets]
        return cls(
            migrate_per_token=migrate[:, None, None],
            prefill_s=prefill[:, 1, None, None],
            prefill_b=prefill[:, 2, None, None],
            prefill_c=prefill[:, 3, None, None],
            fixed=np.array([planner._fixed[(src, t)] for t in targets])[:, None],
            per_seq=np.array([latency.switch_per_seq_time(src, t) for t in targets])[:, None],
            per_token=np.array([latency.switch_per_token_time(src, t) for t in targets])[:, None],
            group_start=start,
            size=int(slots.sum()),
            sum_start=(start + int(slots.sum()) * np.arange(5)[:, None, None])[..., None],
            send_alpha=send_alpha,
            prefill_a=np.repeat(prefill[:, 0], slots.reshape(len(targets), rows).sum(axis=1)),
            capacity=np.repeat(np.array(capacity, dtype=float), dp * rows),
        )


def _snake(replica: np.ndarray, work: np.ndarray, split: int) -> np.ndarray:
    """Child (0 .. split-1) of each item within its replica: most work first, in snake order."""
    order = np.argsort(replica * (work.max(initial=0.0) + 1.0) - work)
    sorted_replica = replica[order]
    starts = np.flatnonzero(np.r_[True, sorted_replica[1:] != sorted_replica[:-1]])
    rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    lap = rank % (2 * split)
    child = np.empty(len(order), dtype=int)
    child[order] = np.where(lap < split, lap, 2 * split - 1 - lap)
    return child


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
        self.decisions: deque[Decision] = deque(maxlen=self.config.history)
        # per-TP constants, looked up once: decide() is on the engine's hot path
        tps = sorted(set(self.config.candidate_tp))
        self._step_coef = {tp: latency.step_coefficients(tp) for tp in tps}
        self._prefill_coef = {tp: latency.prefill_coefficients(tp) for tp in tps}
        self._send_coef = latency.send_coefficients()
        self._capacity = {
            tp: latency.kv_capacity_tokens(tp, self.config.memory_utilization) for tp in tps
        }
        self._fixed = {(a, b): latency.switch_time(a, b, world_size) for a in tps for b in tps}
        self._switch_costs: dict[tuple[int, tuple[int, ...], int], _SwitchCosts] = {}
        self._direction = 0
        self._since_switch = self.config.cooldown_calls
        self._calls = 0  # decide() calls in this rollout

    def new_rollout(self) -> None:
        """A new batch starts: the direction lock and cooldown of the last one no longer apply."""
        self._direction = 0
        self._since_switch = self.config.cooldown_calls
        self._calls = 0

    # --- time model ---------------------------------------------------------------------

    def _times(self, rows: Questions, assignments: np.ndarray, running: RunningSet) -> np.ndarray:
        return slowest_replica_times(rows, assignments, running, self._step_coef)

    def finish_time(
        self, tp: int, num_replicas: int, replica: np.ndarray, running: RunningSet
    ) -> float:
        """Predicted seconds until every sequence has finished in this layout, from now."""
        if len(running) == 0:
            return 0.0
        rows = Questions()
        layout = Layout(dp=num_replicas, tp=tp)
        for q in range(running.remaining.shape[1]):
            rows.add(0, q, False, np.inf, layout)
        return float(self._times(rows, replica[None, :], running).mean())

    def shrinking_share(self, running: RunningSet, current: Layout, steps: int) -> float:
        """What the next `steps` decode steps cost, sequences finishing as predicted (median
        scenario), over what they would at today's batch: in (0, 1], slowest replica each.
        A check `steps` away is that much nearer in time than the batch's pace says."""
        if steps <= 0 or len(running) == 0:
            return 1.0
        rows = Questions()
        rows.add(0, running.remaining.shape[1] // 2, False, float(steps), current)
        shrinking = float(self._times(rows, running.replica[None, :], running)[0])
        full = 0.0
        for r in np.unique(running.replica):
            mine = running.replica == r
            step = self.latency.step_time(current.tp, int(mine.sum()), running.context[mine].sum())
            full = max(full, steps * float(step))
        return min(1.0, shrinking / full) if full > 0 else 1.0

    # --- switching ----------------------------------------------------------------------

    def _assign(self, running: RunningSet, src: Layout, dst: Layout) -> np.ndarray:
        """Growing TP merges whole replicas (sequences stay on the ranks that hold them);
        shrinking splits each replica's requests (`RunningSet.group`; else its sequences)
        over its children, whole, most predicted work first in snake order (0, 1, .., s-1,
        s-1, .., 0): a vectorised near-LPT split, as the engine splits (LPT)."""
        if dst.tp >= src.tp:
            return running.replica // (dst.tp // src.tp)
        split = src.tp // dst.tp
        work = running.remaining.mean(axis=1)
        if running.group is None:
            return running.replica * split + _snake(running.replica, work, split)
        # a unit per (replica, request), its work the sum of its sequences'
        stride = int(running.group.max()) + 1
        units, unit_of = np.unique(
            running.replica.astype(np.int64) * stride + running.group, return_inverse=True
        )
        unit_work = np.bincount(unit_of, weights=work, minlength=len(units))
        unit_replica = units // stride
        child = _snake(unit_replica, unit_work, split)[unit_of]
        return running.replica * split + child

    def _switch_constants(self, src: int, targets: tuple[int, ...], rows: int) -> _SwitchCosts:
        key = (src, targets, rows)
        if key not in self._switch_costs:
            self._switch_costs[key] = _SwitchCosts.build(self, src, targets, rows)
        return self._switch_costs[key]

    def _overheads(
        self,
        src: Layout,
        targets: list[Layout],
        assignments: list[np.ndarray],
        context: np.ndarray,
        alive: np.ndarray,
        holds_kv: np.ndarray,
        shared: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Switch overheads (targets, rows) for rows of (rows, n) contexts, moving the KV of the
        alive sequences that hold some; inf where a replica would exceed max_num_seqs or its
        KV memory with all its alive sequences, queued ones included. Also whether each
        sequence migrates (True) or recomputes its KV, (targets, rows, n). Merging replicas
        (a larger TP) sends the `shared` tokens of each sequence (`RunningSet.shared`) once,
        with the first of them; a split prices them all (its halves may part samples of a
        prompt)."""
        m, (rows, n) = len(targets), context.shape
        k = self._switch_constants(src.tp, tuple(t.tp for t in targets), rows)
        ctx = context.astype(float)
        sent = ctx
        if shared is not None:
            grows = np.array([t.tp > src.tp for t in targets])[:, None, None]
            sent = ctx - np.where(grows, np.minimum(shared, ctx), 0)
        migrate_cost = sent * k.migrate_per_token  # (m, rows, n)
        recompute_cost = k.prefill_s + (k.prefill_b + k.prefill_c * ctx) * ctx
        migrate = migrate_cost <= recompute_cost
        moves = alive & holds_kv
        # five per-replica sums in one bincount: weights stacked, keys offset by `size` each
        weights = np.empty((5, m, rows, n))
        np.multiply(np.minimum(migrate_cost, recompute_cost), moves, out=weights[0])
        np.logical_and(migrate, moves, out=weights[1], casting="unsafe")
        weights[2] = moves
        weights[3] = alive
        np.multiply(alive, ctx, out=weights[4])
        keys = (k.sum_start + np.stack(assignments)[None, :, None, :]).ravel()
        cost, migrating, moving, count, tokens = np.bincount(
            keys, weights=weights.ravel(), minlength=5 * k.size
        ).reshape(5, k.size)
        total = cost + (migrating > 0) * k.send_alpha + (moving > migrating) * k.prefill_a
        fits = (count <= self.config.max_num_seqs) & (tokens <= k.capacity)
        starts = k.group_start.ravel()
        worst = np.maximum.reduceat(total, starts).reshape(m, rows) + k.fixed
        # (m, 1) * (rows,): every rank takes part in exchanging all the sequences in flight
        worst += k.per_seq * alive.sum(axis=-1) + k.per_token * (alive * ctx).sum(axis=-1)
        ok = np.minimum.reduceat(fits, starts).reshape(m, rows)
        return np.where(ok, worst, np.inf), migrate

    def switch_overhead(
        self, running: RunningSet, src: Layout, dst: Layout, assignment: np.ndarray
    ) -> tuple[float, np.ndarray]:
        """Predicted seconds of switching now, and per sequence whether its KV is migrated."""
        alive = np.ones((1, len(running)), dtype=bool)
        context = running.context[None, :]
        overhead, migrate = self._overheads(
            src, [dst], [assignment], context, alive, running.holds_kv, running.shared
        )
        return float(overhead[0, 0]), migrate[0, 0]

    # --- decision -----------------------------------------------------------------------

    def _delays(self, median: np.ndarray) -> np.ndarray:
        """Steps after which a delayed switch is priced: when the given fractions of the
        sequences are predicted finished (median scenario)."""
        at = [int(level * (len(median) - 1)) for level in self.config.delay_levels]
        if not at:
            return np.zeros(0)
        delays = {float(d) for d in np.floor(np.partition(median, at)[at])}
        return np.array(sorted(d for d in delays if d > 0))

    def _never_pays(self, current: Layout, target: Layout, running: RunningSet) -> bool:
        """True when no moment of this rollout can make `target` faster than `current`: each
        replica's sequences only shrink, and at every batch size the busiest replica can
        still have, a step of the target is no faster than one of the current layout's
        replicas in its best case (`_no_faster_step`), at the shortest and the longest
        context a sequence can have."""
        longest = float(running.context.max() + running.remaining.max())
        contexts = (float(running.context.min()), longest)
        busiest = int(np.bincount(running.replica).max())
        return self._no_faster_step(current, target, busiest, contexts)

    def _no_faster_step(
        self, current: Layout, target: Layout, n: int, contexts: tuple[float, float]
    ) -> bool:
        """With at most n sequences on any replica of `current`. Growing merges replicas into
        one that holds their sum, and is slowed by their busiest, of B <= n: the merge is
        fastest against it when the others are empty, so it never pays if step(target, B) >=
        step(current, B) for every B <= n. Shrinking splits a replica's B over k, at best
        ceil(B / k) each: it never pays if step(target, ceil(B / k)) >= step(current, B).
        Every sequence of `contexts` = (shortest, longest) tokens: a step is linear in the
        total and the longest context, so it is checked at the corners of what B sequences
        can hold (all shortest, all longest, one longest among the shortest)."""
        batch = np.arange(1, n + 1, dtype=float)
        grow = target.tp > current.tp
        mine = batch if grow else np.ceil(batch / (current.tp // target.tp))
        for now, then in zip(
            _at_corners(self.latency, current.tp, batch, contexts),
            _at_corners(self.latency, target.tp, mine, contexts),
            strict=True,
        ):
            if (then < now).any():
                return False
        return True

    def never_switches_from(self, current: Layout, max_context: int) -> bool:
        """True when no rollout opened at `current` can ever switch: no candidate is faster
        than it at any batch a replica can hold (max_num_seqs, on either side of a switch)
        with sequences of 1 to `max_context` tokens. Every rank of an engine answers alike
        from the same profile, so the engine can skip its checks without asking the others:
        for a model too small for TP to pay, an opening check alone costs 1-3% of a 0.08 s
        rollout on the CPU box."""
        n = self.config.max_num_seqs
        targets = [t for t in self.candidates if t != current and nested(t, current)]
        return all(self._no_faster_step(current, t, n, (1.0, float(max_context))) for t in targets)

    def may_switch(self, running: RunningSet, current: Layout) -> bool:
        """Whether a switch from `current` could pay before the rollout ends with no sequence
        running longer than `running.remaining.max()` more tokens (`_never_pays`). Given
        every sequence's hard bound (its max_tokens), False spares the caller predicting the
        lengths: whatever they turn out to be, `decide` stays until the rollout ends."""
        return any(not self._never_pays(current, t, running) for t in self._admissible(current))

    def _admissible(self, current: Layout) -> list[Layout]:
        result = []
        for layout in self.candidates:
            if layout == current or not nested(layout, current):
                continue
            if self._direction and (layout.tp > current.tp) != (self._direction > 0):
                continue
            result.append(layout)
        return result

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        """Stay or switch, with the predicted time of every option considered.

        Staying and switching now are priced in every quantile scenario; delaying each switch
        by the `_delays` steps in the median scenario, where a delayed total is the
        switch-now total shifted by what delaying changes in that scenario. All of it in one
        vectorised pass of finish times and one of overheads: a second round of calls for
        the delays alone would cost more than their rows."""
        n, q = running.remaining.shape
        if n == 0:
            raise ValueError("decide() needs at least one unfinished sequence")
        self._calls += 1
        admissible = self._admissible(current)
        targets = [t for t in admissible if not self._never_pays(current, t, running)]
        if admissible and not targets:
            # no switch can pay before the rollout ends: ask again only when it has
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
        assignments = [self._assign(running, current, t) for t in targets]
        med = q // 2
        median = running.remaining[:, med]
        delays = self._delays(median) if targets else np.zeros(0)
        m, k = len(targets), len(delays)
        rows = Questions()
        for col in range(q):
            rows.add(0, col, False, np.inf, current)  # stay to the end
        for j, target in enumerate(targets, start=1):
            for col in range(q):
                rows.add(j, col, True, 0.0, target)  # switch now
        for delay in delays:
            rows.add(0, med, False, delay, current)  # the steps before a delayed switch
        for j, target in enumerate(targets, start=1):
            for delay in delays:
                rows.add(j, med, True, delay, target)  # the steps after it
        # At a rollout's first call a split may pay only with a fold back for the tail (it
        # opened at a TP that suits the tail, where this batch's bulk runs faster on more
        # replicas): "split now, fold back after `delay` steps", median scenario.
        trips = [j for j, t in enumerate(targets) if t.tp < current.tp] if self._calls == 1 else []
        for j in trips:
            for delay in delays:
                rows.add(j + 1, med, False, delay, targets[j])  # split: the steps before
        if trips:
            for delay in delays:
                rows.add(0, med, True, delay, current)  # folded back: the steps after
        all_assignments = np.stack([running.replica, *assignments])
        times = self._times(rows, all_assignments, running)
        split = (m + 1) * q
        now = times[:split].reshape(m + 1, q)
        before = times[split : split + k]
        after = times[split + k : split + k + m * k].reshape(m, k)
        trip_rows = times[split + k + m * k :]
        never = np.zeros(n, dtype=bool)
        options = [Option(current, float(now[0].mean()), 0.0, np.inf, 0, running.replica, never)]
        if targets:
            # row 0 switches now, row 1 + i after delays[i] steps (median scenario)
            steps = np.r_[0.0, delays][:, None]
            context = running.context[None, :] + np.minimum(median[None, :], steps)
            alive = (median[None, :] > steps) | (steps == 0)
            overheads, migrate = self._overheads(
                current, targets, assignments, context, alive, running.holds_kv, running.shared
            )
            run = now[1:].mean(axis=1)
            later_s, later_steps = np.full(m, np.inf), np.zeros(m, dtype=int)
            if k:
                later = before + overheads[:, 1:] + after  # (targets, delays), median scenario
                best = np.argmin(later, axis=1)
                # carry the all-scenario view of switching now over to the delayed plan
                later_s = later[np.arange(m), best] + run - now[1:, med]
                later_steps = delays[best].astype(int)
            for j, (run_s, overhead_s, delayed_s, steps_later) in enumerate(
                zip(
                    run.tolist(),
                    overheads[:, 0].tolist(),
                    later_s.tolist(),
                    later_steps.tolist(),
                    strict=True,
                )
            ):
                options.append(
                    Option(
                        targets[j], run_s, overhead_s, delayed_s, steps_later, assignments[j],
                        migrate[j, 0],
                    )
                )  # fmt: skip
            if trips and k:
                self._price_round_trips(
                    options, trips, trip_rows, delays, context[1:], alive[1:], now, med
                )
        decision = self._choose(options, current, running.seq_ids)
        if decision.action == "stay" and decision.recheck_steps is None and targets:
            decision.quiet_steps = self._quiet(running, current, targets, assignments)
        self.decisions.append(decision)
        return decision

    def _quiet(
        self,
        running: RunningSet,
        current: Layout,
        targets: list[Layout],
        assignments: list[np.ndarray],
    ) -> int:
        """Decode steps before any target group could run a step faster than the replicas it
        merges, were every sequence to finish at its lowest predicted quantile (the scenario
        that shrinks the batch soonest), at any corner of the contexts the sequences can reach
        (`_at_corners`). A switch at a step before then gains no more than one at it
        (the steps between are no faster on the target) and can cost less only by the KV of
        the shorter contexts it moves, which this check priced in its delayed switches: the
        caller need not ask again before then. 0 with a split among the targets (more
        replicas win large batches: nothing to wait for) or a target faster already."""
        if any(t.tp < current.tp for t in targets):
            return 0
        earliest = running.remaining.min(axis=1)
        contexts = (
            float(running.context.min()),
            float(running.context.max() + running.remaining.max()),
        )
        wait = np.inf
        for target, assignment in zip(targets, assignments, strict=True):
            for group in np.unique(assignment):
                mine = assignment == group
                wait = min(
                    wait,
                    self._first_faster_step(
                        current, target, running.replica[mine], earliest[mine], contexts
                    ),
                )
                if wait == 0:
                    return 0
        return int(wait) if np.isfinite(wait) else 0

    def _first_faster_step(
        self,
        current: Layout,
        target: Layout,
        replica: np.ndarray,
        remaining: np.ndarray,
        contexts: tuple[float, float],
    ) -> float:
        """The first step (0: now) at which one `target` group holding these sequences (each
        alive for `remaining` more steps, on `replica` of `current`) runs a step faster than
        the busiest of those replicas, at any corner of `contexts` (`_at_corners`); inf if it
        never does. The counts change only when a sequence finishes, so only those steps are
        priced."""
        steps = np.r_[0.0, np.unique(remaining)]
        alive = remaining[None, :] > steps[:, None]  # (steps, seqs)
        counts = np.stack([alive[:, replica == r].sum(axis=1) for r in np.unique(replica)])
        total = counts.sum(axis=0).astype(float)
        busiest = counts.max(axis=0).astype(float)
        faster = np.zeros(len(steps), dtype=bool)
        for now, then in zip(
            _at_corners(self.latency, current.tp, busiest, contexts),
            _at_corners(self.latency, target.tp, total, contexts),
            strict=True,
        ):
            faster |= (then < now) & (total > 0)
        hit = np.flatnonzero(faster)
        return float(steps[hit[0]]) if len(hit) else np.inf

    def _price_round_trips(
        self,
        options: list[Option],
        trips: list[int],
        rows: np.ndarray,
        delays: np.ndarray,
        context: np.ndarray,
        alive: np.ndarray,
        now: np.ndarray,
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
            back, _ = self._overheads(
                split.layout, [current.layout], [current.assignment], context, alive, holds
            )
            total = split.overhead_s + before[i] + back[0] + after
            best = int(np.argmin(total))
            split.round_trip_s = float(total[best] + now[0].mean() - now[0, med])
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


def _at_corners(
    latency: LatencyModel, tp: int, batch: np.ndarray, contexts: tuple[float, float]
) -> list[np.ndarray]:
    """Step times of `batch` sequences of `contexts` = (shortest, longest) tokens at the
    corners of their (total, longest) contexts: all shortest, all longest, one longest among
    the shortest. A step is linear in both, so a difference of two layouts' steps is least at
    one of them."""
    low, high = contexts
    rest = np.maximum(batch - 1, 0)
    return [
        latency.step_time(tp, batch, rest * others + longest, np.full_like(batch, longest))
        for others, longest in ((low, low), (high, high), (low, high))
    ]
