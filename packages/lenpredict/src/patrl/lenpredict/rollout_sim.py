"""A step-level simulation of a rollout: continuous batching on DP replicas, TP switches.

Each replica follows the engine's scheduler rules: a step prefills newly admitted work (first,
whenever the queue's head fits `max_num_seqs`, `max_num_batched_tokens` and the KV blocks) or
decodes every running sequence; a prompt group is admitted whole and its samples share the
prompt's full blocks; a block shortage preempts the latest admitted sequence for recompute.
Identical decode steps between events are advanced together (a step is linear in the total
and longest context, so k steps cost k · step_time(middle step)). The planner is asked before
the first prefill and every `plan_interval_steps`; a switch waits for the slowest replica,
pays the predicted overhead and moves sequences to the replicas the planner assigned.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from patrl.lenpredict.assignment import AssignmentPolicy, assign_prompts
from patrl.lenpredict.finish_time import RunningSet, shared_prefix
from patrl.lenpredict.latency_model import LatencyModel
from patrl.lenpredict.layout import Layout
from patrl.lenpredict.length_trace import PromptGroup
from patrl.lenpredict.planner import Decision, ReconfigPlanner
from patrl.lenpredict.speculation import SpeculativeTail, effective_step_time, tail_steps


class SimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = Field(default=256, gt=0)  # per replica
    max_num_batched_tokens: int = Field(default=16384, gt=0)  # per prefill step
    block_size: int = Field(default=16, gt=0)
    memory_utilization: float = Field(default=0.9, gt=0, le=1)
    kv_capacity_tokens: int | None = Field(default=None, gt=0)  # per replica; None: from the model
    plan_interval_steps: int = Field(default=64, gt=0)
    assignment: AssignmentPolicy = "lpt"
    # the rollout's max_tokens: bounds what the planner may draw for a sequence's remaining
    # length (PlannerConfig.finish_time="independent"); None: unbounded
    max_response_length: int | None = Field(default=None, gt=0)


@dataclass(slots=True)
class SimSeq:
    seq_id: int
    group: int
    prompt: int
    target: int  # response tokens it will generate (the trace's length)
    shares_prompt: bool = True  # admitted with its group: prompt blocks shared
    generated: int = 0
    finished_at: float = -1.0

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated


@dataclass(slots=True)
class Segment:
    replica: int
    layout: str
    kind: Literal["prefill", "decode", "switch"]
    start_s: float
    end_s: float
    steps: int
    batch: int


@dataclass(slots=True)
class SimResult:
    total_s: float
    segments: list[Segment]
    decisions: list[dict[str, Any]]
    switches: list[tuple[float, str, str]]
    preemptions: int

    def step_timeline(self) -> dict[str, np.ndarray]:
        """One entry per engine step of every replica: replica, kind, start, seconds, batch.
        A segment's steps share its time evenly (each decode step really grows with context;
        the segment's total is exact)."""
        steps = [max(seg.steps, 1) for seg in self.segments]
        per_step = [
            (seg.end_s - seg.start_s) / n for seg, n in zip(self.segments, steps, strict=True)
        ]
        offsets = np.concatenate([np.arange(n) for n in steps]) if steps else np.zeros(0)
        return {
            "replica": np.repeat([seg.replica for seg in self.segments], steps),
            "kind": np.repeat([seg.kind for seg in self.segments], steps),
            "start_s": np.repeat([seg.start_s for seg in self.segments], steps)
            + offsets * np.repeat(per_step, steps),
            "seconds": np.repeat(per_step, steps),
            "batch": np.repeat([seg.batch for seg in self.segments], steps),
        }

    def summary(self) -> dict[str, Any]:
        return {
            "total_s": self.total_s,
            "switches": [list(s) for s in self.switches],
            "planner_calls": len(self.decisions),
            "preemptions": self.preemptions,
        }


RemainingFn = Callable[[list[SimSeq]], np.ndarray]


def oracle_remaining(seqs: list[SimSeq]) -> np.ndarray:
    """The true remaining lengths, as a single quantile column."""
    return np.array([[s.target - s.generated] for s in seqs], dtype=float).reshape(len(seqs), 1)


@dataclass(frozen=True, slots=True)
class StaticPolicy:
    layout: Layout


@dataclass(slots=True)
class AdaptivePolicy:
    planner: ReconfigPlanner
    start: Layout
    remaining: RemainingFn = oracle_remaining


@dataclass(slots=True)
class _Replica:
    index: int
    clock: float
    capacity_blocks: int
    waiting: deque[list[SimSeq]] = field(default_factory=deque)
    running: list[SimSeq] = field(default_factory=list)
    group_refs: dict[int, int] = field(default_factory=dict)  # live samples sharing a prompt

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


class RolloutSimulator:
    """Simulates rollouts (`run`) on one latency model and world. With `speculation` the
    replicas' small decode steps speculate at that tail's speed and verify price
    (patrl.lenpredict.speculation): the simulation then counts token-steps (every running
    sequence one token further), each priced by `effective_step_time`, so a segment's
    `steps` are token-steps and an adaptive policy's planner must price the same tail."""

    def __init__(
        self,
        latency: LatencyModel,
        world_size: int,
        config: SimConfig | None = None,
        speculation: SpeculativeTail | None = None,
    ):
        self.latency = latency
        self.world_size = world_size
        self.config = config or SimConfig()
        self.speculation = speculation
        self.tail = tail_steps(latency, speculation, latency.tp_sizes, self.config.max_num_seqs)

    # --- public ---------------------------------------------------------------------------

    def run(
        self,
        groups: list[PromptGroup],
        policy: StaticPolicy | AdaptivePolicy,
        predicted_lengths: list[float] | None = None,
    ) -> SimResult:
        """Simulate one rollout of `groups`. Prompts are assigned to replicas with the
        predicted lengths (the oracle group means when None)."""
        layout = policy.layout if isinstance(policy, StaticPolicy) else policy.start
        if layout.world_size != self.world_size:
            raise ValueError(f"layout {layout} does not cover world_size={self.world_size}")
        self._check_fits(groups)
        seqs = self._make_seqs(groups)
        by_group: dict[int, list[SimSeq]] = {}
        for s in seqs:
            by_group.setdefault(s.group, []).append(s)
        predicted = predicted_lengths or [float(np.mean(g.response_tokens)) for g in groups]
        replica_of = assign_prompts(
            predicted, [len(g.response_tokens) for g in groups], layout.dp, self.config.assignment
        )
        replicas = [self._new_replica(r, 0.0, layout) for r in range(layout.dp)]
        for g, r in enumerate(replica_of):
            replicas[r].waiting.append(by_group[g])
        self._segments: list[Segment] = []
        self._preemptions = 0
        switches: list[tuple[float, str, str]] = []
        decisions: list[dict[str, Any]] = []
        if isinstance(policy, AdaptivePolicy):
            self._check_planner(policy.planner)
            policy.planner.new_rollout()
        steps = self.config.plan_interval_steps
        while any(r.has_work() for r in replicas):
            # the planner looks first before the prefill: the starting layout is its choice too
            if isinstance(policy, AdaptivePolicy):
                decision = self._plan(policy, replicas, layout)
                decisions.append(decision.record())
                steps = min(self.config.plan_interval_steps, decision.recheck_steps or steps)
                if decision.action == "switch":
                    replicas = self._switch(replicas, layout, decision)
                    switches.append((replicas[0].clock, str(layout), str(decision.target)))
                    layout = decision.target
            for replica in replicas:
                self._advance(replica, layout, steps)
            steps = self.config.plan_interval_steps
        total = max((s.finished_at for s in seqs), default=0.0)
        return SimResult(total, self._segments, decisions, switches, self._preemptions)

    # --- setup ----------------------------------------------------------------------------

    def _check_fits(self, groups: list[PromptGroup]) -> None:
        budget = self.config.max_num_batched_tokens
        for g in groups:
            if g.prompt_tokens + max(g.response_tokens) > budget:
                # a preempted sequence is recomputed by one prefill of all its tokens
                raise ValueError(
                    f"prompt {g.prompt_id!r}: {g.prompt_tokens} prompt + {max(g.response_tokens)} "
                    f"response tokens exceed max_num_batched_tokens={budget}; raise it to at "
                    "least max prompt + max response length"
                )
            if len(g.response_tokens) > self.config.max_num_seqs:
                raise ValueError(
                    f"prompt {g.prompt_id!r} has {len(g.response_tokens)} samples but "
                    f"max_num_seqs={self.config.max_num_seqs}"
                )

    def _check_planner(self, planner: ReconfigPlanner) -> None:
        """The planner must judge layouts by the same budgets the replicas enforce."""
        ours, theirs = self.config, planner.config
        for name in ("max_num_seqs", "memory_utilization"):
            if getattr(ours, name) != getattr(theirs, name):
                raise ValueError(
                    f"planner {name}={getattr(theirs, name)} but the simulator's is "
                    f"{getattr(ours, name)}; set both from the engine's value"
                )
        if ours.kv_capacity_tokens is not None:
            raise ValueError(
                f"kv_capacity_tokens={ours.kv_capacity_tokens} overrides the KV budget the "
                "planner reads from the latency model; leave it None for adaptive runs"
            )
        if planner.speculation != self.speculation:
            raise ValueError(
                f"planner prices speculation {planner.speculation} but the simulated replicas "
                f"run {self.speculation}; give both the same SpeculativeTail"
            )
        if planner.world_size != self.world_size:
            raise ValueError(
                f"planner world_size={planner.world_size}, simulator {self.world_size}"
            )

    @staticmethod
    def _make_seqs(groups: list[PromptGroup]) -> list[SimSeq]:
        seqs: list[SimSeq] = []
        for g, group in enumerate(groups):
            for n in group.response_tokens:
                seqs.append(SimSeq(seq_id=len(seqs), group=g, prompt=group.prompt_tokens, target=n))
        return seqs

    def _new_replica(self, index: int, clock: float, layout: Layout) -> _Replica:
        tokens = self.config.kv_capacity_tokens or self.latency.kv_capacity_tokens(
            layout.tp, self.config.memory_utilization
        )
        return _Replica(index=index, clock=clock, capacity_blocks=tokens // self.config.block_size)

    # --- KV blocks ------------------------------------------------------------------------

    def _blocks(self, seq: SimSeq, extra_tokens: int = 0) -> int:
        """Blocks the sequence holds privately (its group's shared prompt blocks excluded)."""
        bs = self.config.block_size
        own = -(-(seq.tokens + extra_tokens) // bs)
        return own - (seq.prompt // bs if seq.shares_prompt else 0)

    def _used_blocks(self, replica: _Replica) -> int:
        bs = self.config.block_size
        private = sum(self._blocks(s) for s in replica.running)
        shared = sum(s.prompt // bs for s in self._group_heads(replica))
        return private + shared

    @staticmethod
    def _group_heads(replica: _Replica) -> list[SimSeq]:
        seen: dict[int, SimSeq] = {}
        for s in replica.running:
            if s.shares_prompt:
                seen.setdefault(s.group, s)
        return list(seen.values())

    # --- stepping -------------------------------------------------------------------------

    def _advance(self, replica: _Replica, layout: Layout, steps: int) -> None:
        while steps > 0 and replica.has_work():
            if self._prefill(replica, layout):
                steps -= 1
                continue
            if not replica.running:
                raise RuntimeError(
                    f"replica {replica.index} of {layout} cannot admit its next request and runs "
                    "nothing: the KV budget is smaller than one request"
                )
            steps -= self._decode(replica, layout, steps)

    def _admissible(self, replica: _Replica, unit: list[SimSeq], tokens: int, seqs: int) -> bool:
        cfg = self.config
        if seqs + len(unit) > cfg.max_num_seqs:
            return False
        if tokens + self._prefill_tokens(unit) > cfg.max_num_batched_tokens:
            return False
        need = sum(self._blocks(s, 1) for s in unit)
        if unit[0].shares_prompt:
            need += unit[0].prompt // cfg.block_size
        return self._used_blocks(replica) + need <= replica.capacity_blocks

    @staticmethod
    def _prefill_tokens(unit: list[SimSeq]) -> int:
        """A fresh group prefills its prompt once; a preempted sequence recomputes all of it."""
        return unit[0].tokens if len(unit) == 1 and not unit[0].shares_prompt else unit[0].prompt

    def _prefill(self, replica: _Replica, layout: Layout) -> bool:
        admitted: list[list[SimSeq]] = []
        tokens = 0
        while replica.waiting and self._admissible(
            replica, replica.waiting[0], tokens, len(replica.running)
        ):
            unit = replica.waiting.popleft()
            tokens += self._prefill_tokens(unit)
            replica.running.extend(unit)
            admitted.append(unit)
        if not admitted:
            return False
        seconds = self.latency.prefill_time(layout.tp, [self._prefill_tokens(u) for u in admitted])
        start = replica.clock
        replica.clock += seconds
        for unit in admitted:
            for s in unit:
                s.generated += 1
        self._segments.append(
            Segment(
                replica.index, str(layout), "prefill", start, replica.clock, 1, len(replica.running)
            )
        )
        self._retire(replica)
        return True

    def _steps_that_fit(self, replica: _Replica, limit: int) -> int:
        """Largest k <= limit such that k more decode steps fit in the free blocks."""
        bs = self.config.block_size
        tokens = np.array([s.tokens for s in replica.running])
        free = replica.capacity_blocks - self._used_blocks(replica)
        now = -(-tokens // bs)

        def extra(k: int) -> int:
            return int((-(-(tokens + k) // bs) - now).sum())

        if extra(limit) <= free:
            return limit
        lo, hi = 0, limit  # extra(lo) fits, extra(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if extra(mid) <= free else (lo, mid)
        return lo

    def _decode(self, replica: _Replica, layout: Layout, budget: int) -> int:
        """Run identical decode steps up to the next event; returns how many ran."""
        limit = min(budget, min(s.target - s.generated for s in replica.running))
        k = self._steps_that_fit(replica, limit)
        while k == 0:
            self._preempt(replica)
            if not replica.running:
                return 0
            limit = min(budget, min(s.target - s.generated for s in replica.running))
            k = self._steps_that_fit(replica, limit)
        batch = len(replica.running)
        context = sum(s.tokens for s in replica.running)
        longest = max(s.tokens for s in replica.running)
        # every sequence grows by one token a step, so the k steps average the middle one's
        middle = (k - 1) / 2
        seconds = k * float(
            effective_step_time(
                self.latency,
                self.tail.get(layout.tp),
                layout.tp,
                batch,
                context + batch * middle,
                longest + middle,
            )
        )
        start = replica.clock
        replica.clock += seconds
        for s in replica.running:
            s.generated += k
        self._segments.append(
            Segment(replica.index, str(layout), "decode", start, replica.clock, k, batch)
        )
        self._retire(replica)
        return k

    def _preempt(self, replica: _Replica) -> None:
        victim = replica.running.pop()
        victim.shares_prompt = False
        replica.waiting.appendleft([victim])
        self._preemptions += 1

    def _retire(self, replica: _Replica) -> None:
        done = [s for s in replica.running if s.generated >= s.target]
        for s in done:
            s.finished_at = replica.clock
        if done:
            replica.running = [s for s in replica.running if s.generated < s.target]

    # --- reconfiguration ------------------------------------------------------------------

    @staticmethod
    def _unfinished(replicas: list[_Replica]) -> tuple[list[SimSeq], np.ndarray, np.ndarray]:
        """Every unfinished sequence, its replica, and whether it holds KV (is running)."""
        seqs: list[SimSeq] = []
        where: list[int] = []
        has_kv: list[bool] = []
        for r in replicas:
            for s in r.running:
                seqs.append(s)
                where.append(r.index)
                has_kv.append(True)
            for unit in r.waiting:
                seqs.extend(unit)
                where.extend([r.index] * len(unit))
                has_kv.extend([False] * len(unit))
        return seqs, np.array(where, dtype=int), np.array(has_kv, dtype=bool)

    def _plan(self, policy: AdaptivePolicy, replicas: list[_Replica], layout: Layout) -> Decision:
        seqs, where, has_kv = self._unfinished(replicas)
        cap = self.config.max_response_length
        running = RunningSet(
            max_remaining=None
            if cap is None
            else np.array([cap - s.generated for s in seqs], float),
            seq_ids=np.array([s.seq_id for s in seqs]),
            replica=where,
            context=np.array([s.tokens for s in seqs]),
            remaining=policy.remaining(seqs),
            has_kv=has_kv,
            group=np.array([s.group for s in seqs], dtype=int),
            # a group's prompt blocks, where its samples share them, move once a replica
            shared=shared_prefix(
                where,
                np.array([s.group if s.shares_prompt else -1 - s.seq_id for s in seqs]),
                np.array([s.prompt for s in seqs]),
                self.config.block_size,
            ),
        )
        return policy.planner.decide(running, layout)

    def _switch(
        self, replicas: list[_Replica], layout: Layout, decision: Decision
    ) -> list[_Replica]:
        """All replicas wait for the slowest, pay the overhead, and regroup."""
        seqs, _, _ = self._unfinished(replicas)
        target = decision.target
        start = max(r.clock for r in replicas)
        end = start + decision.overhead_s
        for r in replicas:
            self._segments.append(
                Segment(r.index, str(layout), "switch", r.clock, end, 0, len(r.running))
            )
        running = {s.seq_id for r in replicas for s in r.running}
        new = [self._new_replica(i, end, target) for i in range(target.dp)]
        home = dict(
            zip(decision.seq_ids.tolist(), decision.chosen.assignment.tolist(), strict=True)
        )
        # keep each replica's queue order; a queued group moves with its first sample (the
        # planner splits requests whole, as the engine does)
        for r in replicas:
            for unit in r.waiting:
                new[home[unit[0].seq_id]].waiting.append(unit)
        for s in seqs:
            if s.seq_id in running:
                new[home[s.seq_id]].running.append(s)
        crowded = [r.index for r in new if len(r.running) > self.config.max_num_seqs]
        if crowded:
            raise RuntimeError(
                f"switch to {target} put more than max_num_seqs on replicas {crowded}"
            )
        return new
