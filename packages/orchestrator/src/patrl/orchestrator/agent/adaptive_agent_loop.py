"""Agent loops over an adaptive-TP engine: the world's multi-turn samples, one driver, and
folds that move requests between replicas mid-rollout without losing or repeating a turn.

A sample's turn state (its conversation so far, the open tool calls, its counters) lives in
its agent loop's coroutine. Adaptive TP moves requests between TP groups mid-rollout, so
the coroutines must not live with the requests. Here they never move: world rank 0 (the
driver: a group's first rank at every layout, and the controller's deciding rank) runs the
agent loops and the tools of every rank's samples, and the engines of every replica only
run turns. Each round, the driver broadcasts the engine calls its samples made since the
last one, each addressed to a replica (a new turn to the replica with the fewest requests,
a continuation or release to the replica that kept the turn) and whether a check is due;
every rank makes its replica's calls, checks with the world when told (a fold may follow:
`patrl.rollout.adaptive.SteppedRollout`), steps its replica, and the replicas' first ranks
all-gather the turns that finished and their replicas' loads. A fold drops the kept turns'
KV (it rebuilds the cache), so a turn kept before a fold is continued as a new request of
the whole conversation (prefix caching finds what it can); the tokens are the same.

So every rank makes the same collectives in the same order (one broadcast and one
all-gather a round, plus the checks), tools run once per sample, a sample awaiting its tool
holds no decode slot, and a loop that raises on the driver raises on every rank after each
drains its engine. Turns are sampled from their own seeded generators, so the trajectories
are the tokens a run without folds samples. See docs/agent_loop.md ("Adaptive TP").

Partial rollouts (`AdaptiveAgentLoopRunner.run_partial`): the driver counts the world's
ended groups against the world's quota (the sum of the ranks' quotas) and, once it is met,
stops as `AgentLoopRunner.run_partial` does for one engine. The cut of the turns in flight
goes to every replica (a fold may have moved a turn since the driver addressed it; each
replica exports those it holds, without KV, before the round's check, so a fold in the same
round moves none of them), and the exported `SequenceState`s come back in the round's
all-gather from the ranks that were their replicas' first ranks at the cut; the driver builds
each cut sample's `TurnState` from them. A resumed open turn is imported like a new turn, on
the replica with the fewest unfinished requests, its conversation re-prefilled there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from patrl.orchestrator.agent import agent_loop
from patrl.orchestrator.agent.agent_loop import (
    AgentLoop,
    AgentLoopOutput,
    AgentLoopRunner,
    LLMServer,
    Sample,
    TokenOutput,
    TurnCut,
    TurnState,
)
from patrl.orchestrator.agent.multi_turn import MultiTurnRollout
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.scoring import TrajectoryOutput
from patrl.rollout import SamplingParams
from patrl.rollout.adaptive import AdaptiveEngine, SteppedRollout
from patrl.rollout.outputs import RequestOutput, SequenceState
from patrl.tpreshard import broadcast_obj, gather_objects

DRIVER = 0  # the world rank that runs every sample's agent loop

# What a round's all-gather carries from each rank: from a replica's first rank (replica,
# its finished requests, its unfinished requests after the step), else None; the turns this
# rank exported by a cut as its replica's first rank at the cut (before any switch); and the
# error of an engine call of the round that raised here (None: none did).
Report = tuple[tuple[int, list[RequestOutput], int] | None, list[SequenceState], str | None]


class AdaptiveLLMServer(LLMServer):
    """`LLMServer` for an adaptive engine: the driver (world rank 0) serves every sample of
    the world and addresses each engine call to a replica; every rank plays the rounds (see
    the module's docstring). `is_leader` is the driver; `tp_size` stands for the world (more
    than one rank: the runner tells the others the run's end or its error)."""

    def __init__(self, adaptive: AdaptiveEngine, keep_kv: bool = True) -> None:
        super().__init__(adaptive.engine, keep_kv)
        groups, controller = adaptive.groups, adaptive.controller
        if groups is None or controller is None:
            raise ValueError("AdaptiveLLMServer needs an adaptive engine with a controller")
        self.stepped = SteppedRollout(adaptive)
        self.world, self.comm = controller.world, controller.comm
        self.rank = groups.rank
        self.tp_size, self.is_leader = groups.world_size, groups.rank == DRIVER
        self.rounds = 0  # rounds played in the last run
        self._epoch = 0  # switches so far: a turn that finished before one is not kept
        self._finished_in: dict[str, int] = {}  # request id -> epoch it finished in
        self._kept_at: dict[str, int] = {}  # kept turn -> its replica (this epoch)
        self._load: dict[int, int] = {0: 0}  # replica -> unfinished requests (driver's view)
        self._out: dict[int, list[tuple[Any, ...]]] = {}  # the next round's calls by replica
        self._cut_here: list[SequenceState] = []  # exported by this round's cut, to report

    # ------------------------------------------------------------ the driver's samples

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: SamplingParams,
        keep: bool = False,
        continues: str | None = None,
        resumable: bool = False,
    ) -> TokenOutput:
        """`LLMServer.generate`; a turn that finished before a switch is not kept (the
        switch released its KV), so its continuation is submitted whole."""
        out = await super().generate(
            request_id,
            prompt_ids=prompt_ids,
            sampling_params=sampling_params,
            keep=keep,
            continues=continues,
            resumable=resumable,
        )
        if self._finished_in.pop(request_id, self._epoch) != self._epoch:
            self._kept.pop(request_id, None)
        return out

    async def resume_turn(self, state: SequenceState, keep: bool = False) -> TokenOutput:
        """`LLMServer.resume_turn`; a turn that finished before a switch is not kept (the
        switch released its KV), as `generate`'s."""
        out = await super().resume_turn(state, keep)
        if self._finished_in.pop(state.request_id, self._epoch) != self._epoch:
            self._kept.pop(state.request_id, None)
        return out

    def _submit(self, op: tuple[Any, ...]) -> None:
        """Queue engine call `op` for the next round, addressed to its replica: a kept
        turn's continuation or release to the replica that kept it, a new turn or a resumed
        one (an import) to the replica with the fewest unfinished requests (the lowest on a
        tie), a cut to every replica (each exports the turns it holds)."""
        kind = op[0]
        if kind == "cut":
            for replica in sorted(self._load):
                self._out.setdefault(replica, []).append(op)
            self._queued.append(op)
            return
        if kind in ("add", "import"):
            replica = min(self._load, key=lambda r: (self._load[r], r))
        else:
            found = self._kept_at.pop(op[1], None)
            if found is None:  # `generate` and `release` name only turns kept this epoch
                raise RuntimeError(f"kept turn {op[1]!r} is on no replica: this is a bug")
            replica = found
        if kind != "release":
            self._load[replica] += 1
        self._out.setdefault(replica, []).append(op)
        self._queued.append(op)  # `step_until` wakes on it

    def _do(self, op: tuple[Any, ...]) -> None:
        """`LLMServer._do`; a new request (a new turn, a continuation or a resumed turn)
        is noted by the controller as its own length group. A cut exports the turns of
        this replica it names (every rank of the replica alike; its first rank keeps their
        states for the round's report, where the driver wakes their samples)."""
        kind = op[0]
        if kind == "cut":
            engine = self.engine
            here = set(engine.request_ids())
            states = engine.export_requests([r for r in op[1] if r in here], False)
            if engine.layout.tp_rank == 0:
                self._cut_here += states
            return
        super()._do(op)
        if kind == "add":
            self.stepped.note_request(op[1])
        elif kind == "continue":
            self.stepped.note_request(op[2])
        elif kind == "import":
            self.stepped.note_request(op[1].request_id)

    async def step_until(self, done: asyncio.Event) -> None:
        """The driver's rounds: while a call is queued or a replica has work, tell every
        rank the round's calls (and whether a check is due), play it, and wake the samples
        whose turns ended; sleep while every sample awaits a tool (pinging the world every
        HEARTBEAT_S); return once `done` is set and every replica is idle."""
        self._wake = asyncio.Event()
        while True:
            if self._queued or any(self._load.values()):
                calls, self._out, self._queued = self._out, {}, []
                check = self.stepped.due
                self.tell(("round", (calls, check)))
                finished, cut, errors = self._round(calls, check)
                if errors:  # every rank played the round; `_execute` tells them the error
                    raise RuntimeError("an engine call failed: " + "; ".join(errors))
                for replica, out in finished:
                    self._finished_in[out.request_id] = self._epoch
                    self._kept_at[out.request_id] = replica
                    self._pending.pop(out.request_id).set_result(out)
                for state in cut:
                    self._pending.pop(state.request_id).set_exception(TurnCut(state))
                named = {r for ops in calls.values() for op in ops if op[0] == "cut" for r in op[1]}
                lost = sorted(r for r in named if r in self._pending)
                if lost:  # no replica held them: their samples would wait forever
                    raise RuntimeError(f"cut turns {lost} are on no replica: this is a bug")
                await asyncio.sleep(0)  # let the samples whose turn ended go on
            elif done.is_set():
                return
            else:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), agent_loop.HEARTBEAT_S)
                except TimeoutError:
                    self.tell(("wait", None))

    # ------------------------------------------------------------- every rank's part

    def _round(
        self, calls: Mapping[int, Sequence[tuple[Any, ...]]], check: bool
    ) -> tuple[list[tuple[int, RequestOutput]], list[SequenceState], list[str]]:
        """One round, every rank alike: this replica's `calls` (a cut among them exports
        its turns before the check), the check when due (a switch may follow), a step, and
        the all-gather of what finished where and what was cut; returns (replica, output)
        of every turn that finished, the state of every turn cut, and the errors of the
        calls that raised (each rank's, named; its replica's later calls of the round are
        not made, on each of its ranks alike), in rank order. A call that raises does not
        end the round here: the world plays it to its end, and the driver then fails the
        run on every rank, so that no rank waits in a collective for a failed one."""
        engine, stepped = self.engine, self.stepped
        self._cut_here = []
        error: str | None = None
        for op in calls.get(engine.layout.dp_rank, ()):
            try:
                self._do(op)
            except Exception as e:  # told to the driver in this round's report
                error = f"rank {self.rank}: {op[0]}: {type(e).__name__}: {e}"
                break
        if check:
            had_work = engine.has_unfinished() or self.is_leader  # the driver: not over
            verdict = stepped.check(had_work)
            if verdict.target_tp is not None and verdict.target_tp != verdict.from_tp:
                self._switched()
        finished = stepped.step()
        if self.is_leader:
            stepped.count_round()
        self.rounds += 1
        layout = engine.layout
        replica_report = None
        if layout.tp_rank == 0:
            replica_report = (layout.dp_rank, finished, len(engine.request_ids()))
        mine: Report = (replica_report, self._cut_here, error)
        self._cut_here = []
        reports: list[Report] = gather_objects(self.comm, self.world, mine)
        done: list[tuple[int, RequestOutput]] = []
        cut: list[SequenceState] = []
        errors: list[str] = []
        load: dict[int, int] = {}
        for report, exported, failed in reports:
            cut += exported
            if failed is not None:
                errors.append(failed)
            if report is not None:
                replica, outs, left = report
                load[replica] = left
                done += [(replica, out) for out in outs]
        self._load = load
        return done, cut, errors

    def _switched(self) -> None:
        """After a switch (every rank): no turn is kept any more (`SteppedRollout.check`
        released them), so none is continued in place."""
        self._epoch += 1
        self._kept.clear()
        self._kept_at.clear()

    def tell(self, message: tuple[str, Any]) -> None:
        """The driver's `message` to every rank of the world."""
        broadcast_obj(self.comm, self.world, message, src=DRIVER)

    def follow(self) -> list[AgentLoopOutput | TurnState]:
        """A rank other than the driver: play the rounds the driver announces until it
        sends the run's outputs (returned) or its error (raised, after draining the engine
        as the driver does)."""
        while True:
            kind, payload = broadcast_obj(self.comm, self.world, None, src=DRIVER)
            if kind == "round":
                self._round(*payload)
            elif kind == "done":
                self.release_all()
                return list(payload)
            elif kind == "error":
                self.drain()
                raise RuntimeError(f"the adaptive rollout's driver (rank 0) failed: {payload}")

    def begin(self) -> None:
        """A run starts (every rank): the adaptive rollout opens, nothing is kept yet."""
        self.stepped.begin()
        layout = self.engine.layout
        self._load = {r: 0 for r in range(layout.dp_size)}
        self._out, self._queued, self.rounds = {}, [], 0
        self._cut_here = []
        self._kept.clear()
        self._kept_at.clear()
        self._finished_in.clear()

    def drain(self) -> None:
        """`LLMServer.drain`, this replica's engine (every rank, after a failure)."""
        self._out = {}
        super().drain()


class AdaptiveAgentLoopRunner(AgentLoopRunner):
    """`AgentLoopRunner` over an adaptive engine: `run` is a collective over the world.
    Every rank passes its own samples (possibly none); the driver runs the world's, every
    rank plays the rounds, and each rank gets its own samples' outputs back in order.
    `build_loop(name)` builds a loop a peer's sample names that this rank has not built."""

    def __init__(
        self,
        adaptive: AdaptiveEngine,
        agent_loops: Mapping[str, AgentLoop],
        default_agent: str = "tool_agent",
        keep_kv: bool = True,
        build_loop: Callable[[str], AgentLoop] | None = None,
    ) -> None:
        super().__init__(adaptive.engine, agent_loops, default_agent, keep_kv)
        self.adaptive_server = AdaptiveLLMServer(adaptive, keep_kv)
        self.server = self.adaptive_server
        for loop in self.agent_loops.values():
            loop.server_manager = self.server
        self.build_loop = build_loop

    def run(
        self,
        samples: Sequence[Sample],
        sampling_params: SamplingParams | Sequence[SamplingParams],
        on_finish: Callable[[int, AgentLoopOutput], None] | None = None,
    ) -> list[AgentLoopOutput]:
        """Every rank's samples to their end (a world collective); this rank's outputs in
        the order of `samples`. `on_finish(index, output)`: for this rank's samples, as
        the outputs arrive. Raises what a loop raises (every rank)."""
        outs = self._world_run(samples, sampling_params, on_finish, None, None)
        assert all(isinstance(o, AgentLoopOutput) for o in outs)  # no quota: no cut
        return outs  # type: ignore[return-value]

    def run_partial(
        self,
        samples: Sequence[Sample],
        sampling_params: SamplingParams | Sequence[SamplingParams],
        groups: Sequence[Any],
        quota: int,
        on_finish: Callable[[int, AgentLoopOutput], None] | None = None,
    ) -> list[AgentLoopOutput | TurnState]:
        """`AgentLoopRunner.run_partial` over the world (a collective): every rank hands in
        its samples, their group keys (a rank's keys are its own: equal keys of two ranks
        are two groups) and its quota; the driver runs the world's samples until the
        world's quota (the sum of the ranks') of groups ended, then cuts the rest on every
        replica (see the module's docstring). This rank's outputs and TurnStates in the
        order of `samples`; `on_finish` for this rank's samples that ended."""
        return self._world_run(samples, sampling_params, on_finish, groups, quota)

    def _world_run(
        self,
        samples: Sequence[Sample],
        sampling_params: SamplingParams | Sequence[SamplingParams],
        on_finish: Callable[[int, AgentLoopOutput], None] | None,
        groups: Sequence[Any] | None,
        quota: int | None,
    ) -> list[AgentLoopOutput | TurnState]:
        """Gather every rank's share (samples, params, group keys, quota), run the
        world's samples (the driver; the others follow), and hand back this rank's. A
        rank's bad arguments are gathered too, so every rank raises them (ValueError naming
        the rank) instead of the others waiting for it."""
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(samples)
        else:
            params = list(sampling_params)
        problem = None
        if len(params) != len(samples):
            problem = (
                f"{len(params)} sampling params for {len(samples)} samples: need one, or one "
                "per sample"
            )
        elif groups is not None and len(groups) != len(samples):
            problem = f"{len(groups)} group keys for {len(samples)} samples"
        server = self.adaptive_server
        offer = (list(samples), params, None if groups is None else list(groups), quota)
        shares = gather_objects(server.comm, server.world, (offer, problem))
        problems = [f"rank {r}: {p}" for r, (_, p) in enumerate(shares) if p is not None]
        if problems:
            raise ValueError("; ".join(problems))
        shares = [share for share, _ in shares]
        partial = [share[3] is not None for share in shares]
        if any(partial) and not all(partial):
            raise ValueError(
                "the ranks disagree on whether the adaptive rollout is partial (run_partial "
                "on some ranks, run on others): every rank calls the same one"
            )
        every = [s for share in shares for s in share[0]]
        every_params = [p for share in shares for p in share[1]]
        for s in every:
            name = s.get("agent_name", self.default_agent)
            if name not in self.agent_loops and self.build_loop is not None:
                self.add_loop(name, self.build_loop(name))
        server.begin()
        if all(partial):
            keys = [(rank, g) for rank, share in enumerate(shares) for g in share[2]]
            world_quota = sum(share[3] for share in shares)
            outs = self._execute(every, every_params, None, keys, world_quota)
        else:
            outs = self._execute(every, every_params, None, None, None)
        server.stepped.end()
        start = sum(len(share[0]) for share in shares[: server.rank])
        mine = outs[start : start + len(samples)]
        if on_finish is not None:
            for i, out in enumerate(mine):
                if isinstance(out, AgentLoopOutput):
                    on_finish(i, out)
        return mine


class AdaptiveMultiTurnRollout(MultiTurnRollout):
    """`MultiTurnRollout` over an adaptive engine: `generate` is a collective over the world
    (every rank calls it, with its replica's prompts, possibly none), run by an
    `AdaptiveAgentLoopRunner`. An adaptive engine without a controller (one process, nothing
    to adapt) runs as a static TP 1 engine."""

    def __init__(self, config: JobConfig, adaptive: AdaptiveEngine) -> None:
        super().__init__(config, adaptive.engine)
        self.adaptive = adaptive
        if adaptive.controller is not None:
            self.runner = AdaptiveAgentLoopRunner(
                adaptive,
                self.runner.agent_loops,
                self.runner.default_agent,
                build_loop=lambda name: self.classes[name].build(self.context),
            )

    def generate(
        self, items: Sequence[PromptItem], params: Sequence[SamplingParams]
    ) -> list[TrajectoryOutput]:
        """`MultiTurnRollout.generate`; with no prompt of its own a rank still takes part in
        the world's run."""
        if not items and isinstance(self.runner, AdaptiveAgentLoopRunner):
            self.runner.run([], [])
            self.metrics = {}
            return []
        return super().generate(items, params)

    def partial_rows(
        self,
        rows: Sequence[Sample],
        params: Sequence[SamplingParams],
        keys: Sequence[Any],
        quota: int,
    ) -> list[AgentLoopOutput | TurnState]:
        """`MultiTurnRollout.partial_rows`; with no row of its own a rank still takes part
        in the world's run (its quota, 0, counts for nothing)."""
        if isinstance(self.runner, AdaptiveAgentLoopRunner):
            return self.runner.run_partial(rows, params, keys, quota)
        return super().partial_rows(rows, params, keys, quota)
