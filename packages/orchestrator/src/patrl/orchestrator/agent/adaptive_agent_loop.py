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
    TurnState,
)
from patrl.orchestrator.agent.multi_turn import MultiTurnRollout
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.scoring import TrajectoryOutput
from patrl.rollout import SamplingParams
from patrl.rollout.adaptive import AdaptiveEngine, SteppedRollout
from patrl.rollout.outputs import RequestOutput
from patrl.tpreshard import broadcast_obj, gather_objects

DRIVER = 0  # the world rank that runs every sample's agent loop

# What a round's all-gather carries from a replica's first rank: (replica, its finished
# requests, its unfinished requests after the step); None from the other ranks.
Report = tuple[int, list[RequestOutput], int] | None


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

    def _submit(self, op: tuple[Any, ...]) -> None:
        """Queue engine call `op` for the next round, addressed to its replica: a kept
        turn's continuation or release to the replica that kept it, a new turn to the
        replica with the fewest unfinished requests (the lowest on a tie)."""
        kind = op[0]
        if kind == "add":
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
        """`LLMServer._do`; a new request (a new turn or a continuation) is noted by the
        controller as its own length group."""
        super()._do(op)
        if op[0] == "add":
            self.stepped.note_request(op[1])
        elif op[0] == "continue":
            self.stepped.note_request(op[2])

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
                for replica, out in self._round(calls, check):
                    self._finished_in[out.request_id] = self._epoch
                    self._kept_at[out.request_id] = replica
                    self._pending.pop(out.request_id).set_result(out)
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
    ) -> list[tuple[int, RequestOutput]]:
        """One round, every rank alike: this replica's `calls`, the check when due (a
        switch may follow), a step, and the all-gather of what finished where; returns
        (replica, output) of every turn that finished, in rank order."""
        engine, stepped = self.engine, self.stepped
        for op in calls.get(engine.layout.dp_rank, ()):
            self._do(op)
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
        mine: Report = None
        if layout.tp_rank == 0:
            mine = (layout.dp_rank, finished, len(engine.request_ids()))
        reports: list[Report] = gather_objects(self.comm, self.world, mine)
        done: list[tuple[int, RequestOutput]] = []
        load: dict[int, int] = {}
        for report in reports:
            if report is not None:
                replica, outs, left = report
                load[replica] = left
                done += [(replica, out) for out in outs]
        self._load = load
        return done

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
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(samples)
        else:
            params = list(sampling_params)
        if len(params) != len(samples):
            raise ValueError(
                f"{len(params)} sampling params for {len(samples)} samples: need one, or one "
                "per sample"
            )
        server = self.adaptive_server
        shares = gather_objects(server.comm, server.world, (list(samples), params))
        every = [s for share, _ in shares for s in share]
        every_params = [p for _, share in shares for p in share]
        for s in every:
            name = s.get("agent_name", self.default_agent)
            if name not in self.agent_loops and self.build_loop is not None:
                self.add_loop(name, self.build_loop(name))
        server.begin()
        outs = super().run(every, every_params)
        server.stepped.end()
        start = sum(len(share) for share, _ in shares[: server.rank])
        mine = outs[start : start + len(samples)]
        if on_finish is not None:
            for i, out in enumerate(mine):
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
