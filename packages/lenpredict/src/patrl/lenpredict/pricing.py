"""What plans cost: finish times of a running set in a layout, and the overhead of switching
to a layout (barrier, weight reshard, and per sequence a KV migrate or recompute, whichever
the latency model prices lower). Every answer is vectorised over targets and scenarios,
because the planner asks them on the engine's hot path."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from patrl.lenpredict.finish_time import Questions, RunningSet, slowest_replica_times
from patrl.lenpredict.latency_model import LatencyModel
from patrl.lenpredict.layout import Layout
from patrl.lenpredict.speculation import (
    SpeculativeTail,
    TailStep,
    effective_step_time,
    tail_steps,
)

__all__ = ["PlanPricer", "at_corners"]


class PlanPricer:
    """Prices plans for one world on one latency model; per-TP constants looked up once.

    A replica may hold at most `max_num_seqs` sequences and the KV tokens that fit
    `memory_utilization` of its memory: a plan that exceeds either costs inf. With a
    `speculation` tail (patrl.lenpredict.speculation) every step is priced per token-step at
    its real speed: the small steps that speculate at the tail's tokens per step and verify
    price, the others as decode steps; None prices every step as a decode step."""

    def __init__(
        self,
        latency: LatencyModel,
        world_size: int,
        tp_sizes: Iterable[int],
        *,
        memory_utilization: float,
        max_num_seqs: int,
        speculation: SpeculativeTail | None = None,
    ) -> None:
        tps = sorted(set(tp_sizes))
        self.tp_sizes = tps
        self.latency = latency
        self.world_size = world_size
        self.max_num_seqs = max_num_seqs
        self.step_coef = {tp: latency.step_coefficients(tp) for tp in tps}
        self.prefill_coef = {tp: latency.prefill_coefficients(tp) for tp in tps}
        self.send_coef = latency.send_coefficients()
        self.capacity = {tp: latency.kv_capacity_tokens(tp, memory_utilization) for tp in tps}
        self.fixed = {(a, b): latency.switch_time(a, b, world_size) for a in tps for b in tps}
        self._switch_costs: dict[tuple[int, tuple[int, ...], int], _SwitchCosts] = {}
        self.speculation: SpeculativeTail | None = None
        self.tail: dict[int, TailStep] = {}
        self.set_speculation(speculation)

    def set_speculation(self, speculation: SpeculativeTail | None) -> None:
        """Price the steps of a speculating tail from now on (None: none speculates)."""
        self.speculation = speculation
        self.tail = tail_steps(self.latency, speculation, self.tp_sizes, self.max_num_seqs)

    def step_time(
        self,
        tp: int,
        batch: np.ndarray | float,
        context_tokens: np.ndarray | float,
        max_context: np.ndarray | float | None = None,
    ) -> np.ndarray:
        """Seconds of a token-step at TP size `tp` (`speculation.effective_step_time`)."""
        return effective_step_time(
            self.latency, self.tail.get(tp), tp, batch, context_tokens, max_context
        )

    # --- finish times -------------------------------------------------------------------

    def times(self, rows: Questions, assignments: np.ndarray, running: RunningSet) -> np.ndarray:
        """Seconds of each question in `rows` (`finish_time.slowest_replica_times`)."""
        return slowest_replica_times(rows, assignments, running, self.step_coef, self.tail)

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
        return float(self.times(rows, replica[None, :], running).mean())

    def shrinking_share(self, running: RunningSet, current: Layout, steps: int) -> float:
        """What the next `steps` decode steps cost, sequences finishing as predicted (median
        scenario), over what they would at today's batch: in (0, 1], slowest replica each."""
        if steps <= 0 or len(running) == 0:
            return 1.0
        rows = Questions()
        rows.add(0, running.remaining.shape[1] // 2, False, float(steps), current)
        shrinking = float(self.times(rows, running.replica[None, :], running)[0])
        full = 0.0
        for r in np.unique(running.replica):
            mine = running.replica == r
            step = self.step_time(current.tp, int(mine.sum()), running.context[mine].sum())
            full = max(full, steps * float(step))
        return min(1.0, shrinking / full) if full > 0 else 1.0

    # --- switch overheads ---------------------------------------------------------------

    def overheads(
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
        alive sequences that hold some (inf where a replica would not fit them), and whether
        each sequence migrates (True) or recomputes its KV, (targets, rows, n). Merging
        replicas sends each sequence's `shared` tokens (`RunningSet.shared`) once; a split
        prices them all (its halves may part samples of a prompt)."""
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
        fits = (count <= self.max_num_seqs) & (tokens <= k.capacity)
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
        overhead, migrate = self.overheads(
            src, [dst], [assignment], context, alive, running.holds_kv, running.shared
        )
        return float(overhead[0, 0]), migrate[0, 0]

    def _switch_constants(self, src: int, targets: tuple[int, ...], rows: int) -> _SwitchCosts:
        key = (src, targets, rows)
        if key not in self._switch_costs:
            self._switch_costs[key] = _SwitchCosts.build(self, src, targets, rows)
        return self._switch_costs[key]

    # --- when no switch can pay ---------------------------------------------------------

    def never_pays(self, current: Layout, target: Layout, running: RunningSet) -> bool:
        """True when no moment of this rollout can make `target` faster than `current`: at
        every batch size the busiest replica can still have and every context a sequence can
        reach, a step of the target is no faster (`no_faster_step`)."""
        longest = float(running.context.max() + running.remaining.max())
        contexts = (float(running.context.min()), longest)
        busiest = int(np.bincount(running.replica).max())
        return self.no_faster_step(current, target, busiest, contexts)

    def no_faster_step(
        self, current: Layout, target: Layout, n: int, contexts: tuple[float, float]
    ) -> bool:
        """With at most n sequences on any replica of `current`, of `contexts` = (shortest,
        longest) tokens: True when no step of `target` beats `current`'s. A merge is fastest
        against its busiest replica B <= n when the others are empty, so it is checked at
        step(target, B); a split into k at best holds ceil(B / k). A step is linear in the
        total and the longest context, so only the corners (`at_corners`) are checked."""
        batch = np.arange(1, n + 1, dtype=float)
        grow = target.tp > current.tp
        mine = batch if grow else np.ceil(batch / (current.tp // target.tp))
        for now, then in zip(
            at_corners(self.latency, current.tp, batch, contexts, self.tail.get(current.tp)),
            at_corners(self.latency, target.tp, mine, contexts, self.tail.get(target.tp)),
            strict=True,
        ):
            if (then < now).any():
                return False
        return True

    def quiet_steps(
        self,
        running: RunningSet,
        current: Layout,
        targets: list[Layout],
        assignments: list[np.ndarray],
    ) -> int:
        """Decode steps before any target group could run a step faster than the replicas it
        merges, every sequence finishing at its lowest predicted quantile, at any corner of
        the contexts it can reach: a switch before then gains no more than one at it, so the
        caller need not ask again sooner. 0 with a split among the targets (more replicas win
        large batches: nothing to wait for) or a target faster already."""
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
        alive `remaining` more steps, on `replica` of `current`) runs a step faster than the
        busiest of those replicas, at any corner of `contexts`; inf if never. Counts change
        only when a sequence finishes, so only those steps are priced."""
        steps = np.r_[0.0, np.unique(remaining)]
        alive = remaining[None, :] > steps[:, None]  # (steps, seqs)
        counts = np.stack([alive[:, replica == r].sum(axis=1) for r in np.unique(replica)])
        total = counts.sum(axis=0).astype(float)
        busiest = counts.max(axis=0).astype(float)
        faster = np.zeros(len(steps), dtype=bool)
        for now, then in zip(
            at_corners(self.latency, current.tp, busiest, contexts, self.tail.get(current.tp)),
            at_corners(self.latency, target.tp, total, contexts, self.tail.get(target.tp)),
            strict=True,
        ):
            faster |= (then < now) & (total > 0)
        hit = np.flatnonzero(faster)
        return float(steps[hit[0]]) if len(hit) else np.inf


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
        cls, pricer: PlanPricer, src: int, targets: tuple[int, ...], rows: int
    ) -> _SwitchCosts:
        world = pricer.world_size
        dp = np.array([world // t for t in targets])
        latency = pricer.latency
        migrate = np.array([latency.switch_migrate_per_token(src, t) for t in targets])
        prefill = np.array([pricer.prefill_coef[t] for t in targets])
        slots = np.repeat(dp, rows)
        start = np.r_[0, np.cumsum(slots)[:-1]].reshape(len(targets), rows)
        capacity = [pricer.capacity[t] for t in targets]
        return cls(
            migrate_per_token=migrate[:, None, None],
            prefill_s=prefill[:, 1, None, None],
            prefill_b=prefill[:, 2, None, None],
            prefill_c=prefill[:, 3, None, None],
            fixed=np.array([pricer.fixed[(src, t)] for t in targets])[:, None],
            per_seq=np.array([latency.switch_per_seq_time(src, t) for t in targets])[:, None],
            per_token=np.array([latency.switch_per_token_time(src, t) for t in targets])[:, None],
            group_start=start,
            size=int(slots.sum()),
            sum_start=(start + int(slots.sum()) * np.arange(5)[:, None, None])[..., None],
            send_alpha=pricer.send_coef[0],
            prefill_a=np.repeat(prefill[:, 0], slots.reshape(len(targets), rows).sum(axis=1)),
            capacity=np.repeat(np.array(capacity, dtype=float), dp * rows),
        )


def at_corners(
    latency: LatencyModel,
    tp: int,
    batch: np.ndarray,
    contexts: tuple[float, float],
    tail: TailStep | None = None,
) -> list[np.ndarray]:
    """Step times of `batch` sequences of `contexts` = (shortest, longest) tokens at the
    corners of their (total, longest) contexts: all shortest, all longest, one longest among
    the shortest. A step is linear in both, so a difference of two layouts' steps is least at
    one of them. With `tail`, per token-step where it speculates (`effective_step_time`, at a
    given batch still linear in both contexts)."""
    low, high = contexts
    rest = np.maximum(batch - 1, 0)
    return [
        effective_step_time(
            latency, tail, tp, batch, rest * others + longest, np.full_like(batch, longest)
        )
        for others, longest in ((low, low), (high, high), (low, high))
    ]
