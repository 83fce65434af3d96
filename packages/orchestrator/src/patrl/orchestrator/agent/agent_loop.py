"""Agent loops over patrl's engine: many samples' multi-turn conversations, one engine, tokens
in and tokens out. verl's shape (`verl.experimental.agent_loop`): an `AgentLoop` subclass
writes one sample's logic as `async def run(...) -> AgentLoopOutput`, awaiting
`self.server_manager.generate(...)` for each model turn; `AgentLoopRunner` runs every sample's
`run` at once on one event loop and steps the engine between them, so while one sample awaits
its tool, the engine keeps decoding the others (continuous batching is never held up).

Each generation is submitted as the whole conversation's token ids. A turn generated with
`keep=True` stays in the engine with its KV (`Engine.continue_request`), and the next turn,
naming it in `continues`, extends that KV: the engine prefills exactly the appended tokens
(the tool's answer) and the previous turn's last sampled token, never the conversation again.
A turn that is not continued is released (`LLMServer.release`, and every kept turn at the end
of a run or on its failure). With `keep_kv=False` (or for a loop that does not pass
`keep`/`continues`) each turn is a new request, and prefix caching finds the conversation's
full KV blocks: the slow twin the tests compare with.

At TP > 1 the TP group's first rank runs the agent loops and the tools alone and drives its
peers: before each engine step it broadcasts the requests its samples submitted since the
last one, and every rank then adds them and steps, so all ranks make the same engine calls in
the same order (the engine's SPMD contract) whatever the tools' timing or answers; at the end
it broadcasts the outputs. Tools run once per group, so a nondeterministic tool cannot make
the ranks diverge, and a tool's side effects happen once. See docs/agent_loop.md.

Partial rollouts (`AgentLoopRunner.run_partial`): once `quota` groups of samples have ended,
the runner stops the samples of loops that can resume (`AgentLoop.resumable`): a model turn in
the engine is exported (its tokens so far and generator state, no KV: the next step recomputes
it under its weights, as the single-turn partial path does), a sample inside a tool call lets
the call finish (re-running it at resume would repeat its side effects) and stops before its
next turn. Each stopped sample comes back as its picklable `TurnState`, from which its loop's
`run(..., resume=state)` goes on. Samples of loops that cannot resume run to their end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from patrl.rollout import Engine, SamplingParams, SequenceState
from patrl.rollout.outputs import RequestOutput
from patrl.tpreshard.comm import broadcast_obj

# While every sample of a TP group awaits a tool, the group's first rank tells its peers so
# this often (seconds), so that none waits in one collective for a whole tool call.
HEARTBEAT_S = 1.0


@dataclass(slots=True)
class AgentLoopOutput:
    """One sample's trajectory (verl's AgentLoopOutput): `prompt_ids` (the rendered prompt)
    then `response_ids` (every model turn and every appended tool turn, in order).
    `response_mask[i]` is 1 where response_ids[i] was sampled by the engine, 0 where it was
    appended (tool answers, chat-template glue); `response_logprobs[i]` is the engine's
    logprob of a sampled token, 0.0 on appended ones. The three lists have one length."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    num_turns: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)
    reward_score: float | None = None


@dataclass(slots=True)
class TokenOutput:
    """One model turn (verl's TokenOutput): the sampled ids, their logprobs, and why the turn
    ended (the engine's finish_reason and stop_reason)."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    stop_reason: int | str | None = None


@dataclass(slots=True)
class TurnState:
    """A multi-turn sample stopped mid-conversation by a partial rollout's cut, picklable (it
    is saved in the run checkpoint), to go on with `ToolAgentLoop.run(..., resume=state)`.

    `prompt_ids` + `response_ids` are the conversation so far, exactly the ids sampled and
    appended (`response_mask` 1 on sampled ids, `response_logprobs` the engine's logprob there,
    under the weights that sampled it, 0.0 on appended ones); the assistant and user turns and
    the tool metrics so far; the sample's `sampling_params` (a turn's seed derives from them
    and the turn number); `request`, the prefix of its turns' request ids; `open_turn`, the
    model turn in the engine at the cut (its prompt is the conversation so far, its tokens so
    far, its generator state), or None when the sample stopped between turns (after its tool
    calls' answers were appended). `open_turn`'s tokens are not in `response_ids` yet."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    assistant_turns: int
    user_turns: int
    metrics: dict[str, int]
    sampling_params: SamplingParams
    request: str
    open_turn: SequenceState | None = None
    # with an interaction (verl's): the conversation as messages (the prompt's, each model turn
    # decoded, each tool and user message as appended) and the interaction's turn scores
    messages: list[dict[str, Any]] | None = None
    turn_scores: list[float] = field(default_factory=list)

    def model_tokens(self) -> int:
        """The sampled tokens so far, the open turn's included."""
        return sum(self.response_mask) + (
            len(self.open_turn.output_token_ids) if self.open_turn is not None else 0
        )


class TurnCut(Exception):
    """Raised by `LLMServer.generate(..., resumable=True)` and `resume_turn` once the runner
    stopped (its quota met): `open_turn` is the turn's exported state (None: not started)."""

    def __init__(self, open_turn: SequenceState | None) -> None:
        super().__init__("the partial rollout's quota is met")
        self.open_turn = open_turn


class SampleCut(Exception):
    """Raised by a resumable loop's `run` on `TurnCut`: the sample's `TurnState`."""

    def __init__(self, state: TurnState) -> None:
        super().__init__("a sample stopped by a partial rollout's cut")
        self.state = state


@dataclass(frozen=True, slots=True)
class AgentLoopContext:
    """What a training job gives an agent loop class to build itself (`AgentLoop.build`):
    the engine's tokenizer and EOS ids, the job's tool pool (a `ToolPool`), the trajectory's
    token budget (`data.max_response_length`), the `rollout.multi_turn` section and its
    interactions by name (`interaction.load_interactions`; empty: none configured)."""

    tokenizer: Any
    tool_pool: Any
    eos_token_ids: tuple[int, ...]
    response_length: int
    multi_turn: Any
    interactions: Mapping[str, Any] = field(default_factory=dict)


class AgentLoop:
    """One sample's conversation logic (verl's AgentLoopBase). Subclasses implement `run`,
    awaiting `self.server_manager.generate` for model turns; one instance serves every sample
    of a run (per-sample state lives in `run`'s locals). `@register(name)` (verl's) makes a
    subclass selectable by a data row's `agent_name`."""

    server_manager: LLMServer
    # Whether `run` accepts `resume=TurnState` and raises SampleCut on TurnCut (ToolAgentLoop):
    # a partial rollout stops such samples at its quota; others run to their end in-step.
    resumable: bool = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def build(cls, context: AgentLoopContext) -> AgentLoop:
        """The instance a training job runs (`MultiTurnRollout`): `cls(tokenizer)` unless a
        subclass needs more of `context`."""
        return cls(context.tokenizer)

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        """Run one sample to its end; `kwargs` are the sample's fields (e.g. `raw_prompt`,
        the chat messages, and `tools_kwargs`)."""
        raise NotImplementedError


class LLMServer:
    """One engine, shared by the samples of a run (verl's AsyncLLMServerManager): `generate`
    queues a request and resolves when the engine finishes it; the runner's step task drives
    the engine. Only the event loop's thread touches the engine. At TP > 1 this is the TP
    group's first rank's server; its peers `follow` it (see the module's docstring).
    `keep_kv`: honour `keep`/`continues` (kept KV between turns); False ignores them."""

    def __init__(self, engine: Engine, keep_kv: bool = True) -> None:
        self.engine = engine
        self.keep_kv = keep_kv
        # kept turns by request id: the conversation's ids through that turn's last token
        self._kept: dict[str, list[int]] = {}
        self._pending: dict[str, asyncio.Future[RequestOutput]] = {}
        self._wake: asyncio.Event | None = None
        layout = engine.layout
        self.tp_size, self.is_leader = layout.tp_size, layout.is_tp_first
        self._queued: list[tuple[Any, ...]] = []  # TP > 1: the next step's engine calls
        self.stopping = False  # a partial rollout's quota is met: resumable turns are cut
        self._resumable: set[str] = set()  # pending turns that a cut exports
        self.cached_prefix_tokens = 0  # at submission, by the prefix cache's count
        self.submitted_tokens = 0

    @property
    def max_model_len(self) -> int:
        """Prompt and response tokens of one request at most (the engine's)."""
        return int(self.engine.max_model_len)

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
        """Sample one model turn continuing `prompt_ids` (n must be 1). `keep`: hold the
        turn's KV for a continuation until `release`; `continues`: the kept turn whose
        conversation `prompt_ids` extends (its KV is extended by the new ids only; when
        `prompt_ids` does not extend it, it is released and `prompt_ids` submitted whole).
        `resumable`: a partial rollout's cut may stop the turn (TurnCut, raised at once when
        the runner is already stopping)."""
        if sampling_params.n != 1:
            raise ValueError(
                f"an agent loop samples one turn at a time: n must be 1, got {sampling_params.n}"
            )
        if self._wake is None:
            raise RuntimeError("LLMServer.generate runs inside AgentLoopRunner.run")
        if request_id in self._pending or request_id in self.engine.request_ids():
            raise ValueError(f"request id {request_id!r} is already in use")
        self.engine.check_params(sampling_params)
        if resumable and self.stopping:
            raise TurnCut(None)
        ids, keep = list(prompt_ids), keep and self.keep_kv
        op: tuple[Any, ...] = ("add", request_id, ids, sampling_params, keep)
        base = self._kept.pop(continues, None) if continues is not None else None
        if base is not None:
            if self.keep_kv and ids[: len(base)] == base:
                op = ("continue", continues, request_id, ids[len(base) :], sampling_params, keep)
            else:
                self._submit(("release", continues))
        self._submit(op)
        result = await self._await(request_id, resumable)
        out = result.outputs[0]
        if out.finish_reason == "rejected":
            raise ValueError(f"the engine rejected turn {request_id}: {result.error}")
        if keep and out.finish_reason in ("stop", "length"):
            self._kept[request_id] = ids + list(out.token_ids)
        return TokenOutput(
            list(out.token_ids), list(out.logprobs), out.finish_reason, out.stop_reason
        )

    async def resume_turn(self, state: SequenceState, keep: bool = False) -> TokenOutput:
        """Go on with a model turn a cut exported (`TurnCut.open_turn`, or a lost rank's
        snapshot): its KV recomputed under the engine's weights, its sampling from its
        generator state, so the turn is the one it would have been uncut under these weights.
        The whole turn comes back, the tokens sampled before the cut first (their logprobs as
        sampled then). `keep`: True keeps the turn's KV for a continuation (as `generate`'s
        `keep`: the next turn names it in `continues`, or `release` frees it), False frees it
        at its end, whatever flag the state was exported with. TurnCut(state) at once when
        the runner is stopping."""
        if self._wake is None:
            raise RuntimeError("LLMServer.resume_turn runs inside AgentLoopRunner.run")
        if self.stopping:
            raise TurnCut(state)
        rid = state.request_id
        if rid in self._pending or rid in self.engine.request_ids():
            raise ValueError(f"request id {rid!r} is already in use")
        keep = keep and self.keep_kv
        self._submit(("import", replace(state, keep=keep)))
        out = (await self._await(rid, True)).outputs[0]
        if keep and out.finish_reason in ("stop", "length"):
            self._kept[rid] = list(state.prompt_token_ids) + list(out.token_ids)
        return TokenOutput(
            list(out.token_ids), list(out.logprobs), out.finish_reason, out.stop_reason
        )

    async def _await(self, request_id: str, resumable: bool) -> RequestOutput:
        """The engine's output of submitted request `request_id` (TurnCut when cut)."""
        assert self._wake is not None
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        if resumable:
            self._resumable.add(request_id)
        self._wake.set()
        try:
            return await future
        finally:
            self._resumable.discard(request_id)

    def stop(self) -> None:
        """A partial rollout's quota is met: cut every resumable turn in the engine (each
        awaiting sample gets TurnCut with its exported state), and every resumable turn asked
        for from now on. Turns of loops that cannot resume go on."""
        if self.stopping:
            return
        self.stopping = True
        cut = sorted(rid for rid in self._pending if rid in self._resumable)
        if cut:
            self._submit(("cut", cut))
        if self._wake is not None:
            self._wake.set()

    def release(self, request_id: str) -> None:
        """Free kept turn `request_id`'s KV (its conversation goes no further); a turn that
        is not kept is ignored."""
        if self._kept.pop(request_id, None) is not None:
            self._submit(("release", request_id))

    def release_all(self) -> None:
        """Release every kept turn (the end of a run; every rank of a TP group calls it)."""
        self._kept.clear()
        self.engine.release_kept()

    def _submit(self, op: tuple[Any, ...]) -> None:
        """Make engine call `op` now (TP 1), or on every rank at the next step (TP > 1)."""
        if self.tp_size > 1:
            self._queued.append(op)
        else:
            self._do(op)

    def _do(self, op: tuple[Any, ...]) -> None:
        """One engine call: ("add", id, ids, params, keep), ("continue", kept id, id,
        appended ids, params, keep), ("release", kept id), ("import", SequenceState) or
        ("cut", ids): export those requests without KV (on the first rank, each one's
        awaiting sample gets TurnCut with its state)."""
        kind, *args = op
        engine = self.engine
        if kind == "add":
            request_id, ids, params, keep = args
            self.submitted_tokens += len(ids)
            self.cached_prefix_tokens += engine.cache.blocks.num_cached_prefix(ids)
            engine.add_request(ids, params, request_id=request_id, keep=keep)
        elif kind == "continue":
            kept, request_id, appended, params, keep = args
            engine.continue_request(kept, appended, params, request_id, keep)
        elif kind == "release":
            if args[0] in engine.kept_request_ids():
                engine.release(args[0])
        elif kind == "import":
            engine.import_requests([args[0]])
        elif kind == "cut":
            here = set(engine.request_ids())
            for state in engine.export_requests([r for r in args[0] if r in here], False):
                future = self._pending.pop(state.request_id, None)
                if future is not None and not future.done():
                    future.set_exception(TurnCut(state))
        else:
            raise ValueError(f"unknown engine call {kind!r}")

    def _apply(self, ops: Sequence[tuple[Any, ...]]) -> list[RequestOutput]:
        """One step of the group's protocol, the same on every rank: make the calls `ops`,
        then step."""
        for op in ops:
            self._do(op)
        return self.engine.step()

    def tell(self, message: tuple[str, Any]) -> None:
        """The group's first rank's `message` to its peers (TP > 1)."""
        layout = self.engine.layout
        broadcast_obj(layout.tp_comm, layout.tp_group, message)

    async def step_until(self, done: asyncio.Event) -> None:
        """Step the engine while it has requests; sleep until a sample submits one; return
        once `done` is set and no request is left. At TP > 1 each step's new requests go to
        the peers first, and a quiet wait pings them every HEARTBEAT_S."""
        self._wake = asyncio.Event()
        while True:
            if self._queued or self.engine.has_unfinished():
                ops, self._queued = self._queued, []
                if self.tp_size > 1:
                    self.tell(("step", ops))
                for out in self._apply(ops):
                    self.turn_ended(out)
                    self._pending.pop(out.request_id).set_result(out)
                await asyncio.sleep(0)  # let the samples whose turn ended go on
            elif done.is_set():
                return
            else:
                self._wake.clear()
                if self.tp_size == 1:
                    await self._wake.wait()
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), HEARTBEAT_S)
                except TimeoutError:
                    self.tell(("wait", None))

    def turn_ended(self, out: RequestOutput) -> None:
        """The step task's note of each turn the engine finished, made before the turn's
        sample is woken (a subclass that reports turns in flight records it here, as the
        sample may not run before the report); nothing by default."""

    def follow(self) -> list[AgentLoopOutput | TurnState]:
        """A TP group peer's part of a run: add and step as the group's first rank says,
        until it sends the run's outputs (returned) or its error (raised, after aborting and
        draining the engine as the first rank does)."""
        while True:
            kind, payload = broadcast_obj(
                self.engine.layout.tp_comm, self.engine.layout.tp_group, None
            )
            if kind == "step":
                self._apply(payload)
            elif kind == "done":
                self.release_all()
                return list(payload)
            elif kind == "error":
                self.drain()
                raise RuntimeError(f"the TP group's first rank failed its agent loops: {payload}")

    def drain(self) -> None:
        """Abort every request, step until the engine is idle and release every kept turn
        (after a failure)."""
        self._queued = []
        for rid in self.engine.request_ids():
            self.engine.abort(rid)
        while self.engine.has_unfinished():
            self.engine.step()
        self.release_all()

    def finish(self, done: asyncio.Event) -> None:
        """Set `done` and wake the step task, so that it returns once the engine is idle."""
        done.set()
        if self._wake is not None:
            self._wake.set()

    def fail_pending(self, error: BaseException) -> None:
        """Wake every waiting sample with `error` (the engine failed)."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()


Sample = Mapping[str, Any]

L = TypeVar("L", bound=type[AgentLoop])
_REGISTRY: dict[str, type[AgentLoop]] = {}


def register(name: str) -> Callable[[L], L]:
    """Class decorator (verl's `@register("tool_agent")`): a data row whose `agent_name` is
    `name` runs this AgentLoop subclass. A second class under one name is a ValueError (a
    module imported twice re-registers its own class, which is allowed)."""

    def add(cls: L) -> L:
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise TypeError(f"@register({name!r}) decorates AgentLoop subclasses, not {cls!r}")
        old = _REGISTRY.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (
            cls.__module__,
            cls.__qualname__,
        ):
            raise ValueError(
                f"agent loop name {name!r} is taken by {old.__module__}.{old.__qualname__}"
            )
        _REGISTRY[name] = cls
        return cls

    return add


def registered_agent_loops() -> dict[str, type[AgentLoop]]:
    """Every `@register`ed agent loop class by name (those of modules imported so far)."""
    return dict(_REGISTRY)


class AgentLoopRunner:
    """Runs many samples' agent loops over one engine at once: `run(samples, params)` ->
    their AgentLoopOutputs in order. Each sample picks its loop by its `agent_name` field
    (verl's), `default_agent` when it has none; the other fields are passed to the loop's
    `run`. `sampling_params` is one for every sample or one per sample (each sample of a group
    its own seed). `on_finish(index, output)` is called as each sample ends."""

    def __init__(
        self,
        engine: Engine,
        agent_loops: Mapping[str, AgentLoop],
        default_agent: str = "tool_agent",
        keep_kv: bool = True,
    ) -> None:
        """`keep_kv`: the engine keeps each conversation's KV between its turns (see the
        module's docstring; False: every turn is a new request, over prefix caching)."""
        if not agent_loops:
            raise ValueError("AgentLoopRunner needs at least one agent loop")
        self.server = LLMServer(engine, keep_kv)
        self.agent_loops: dict[str, AgentLoop] = {}
        self.default_agent = default_agent
        for name, loop in agent_loops.items():
            self.add_loop(name, loop)

    def add_loop(self, name: str, loop: AgentLoop) -> None:
        """Samples whose `agent_name` is `name` run `loop` from the next `run` on."""
        loop.server_manager = self.server
        self.agent_loops[name] = loop

    def run(
        self,
        samples: Sequence[Sample],
        sampling_params: SamplingParams | Sequence[SamplingParams],
        on_finish: Callable[[int, AgentLoopOutput], None] | None = None,
    ) -> list[AgentLoopOutput]:
        """Every sample to its end; raises what a loop raises (after stopping the others)."""
        outs = self._execute(samples, sampling_params, on_finish, None, None)
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
        """A partial rollout: run the samples until `quota` groups have ended (a group is
        the samples of one `groups` key, e.g. a prompt's `rollout.n`; quota <= 0 stops at
        once), then stop the rest (`LLMServer.stop`: resumable loops' samples are cut, the
        others run to their end). Each sample's AgentLoopOutput, or its TurnState where it was
        cut; a sample's field `resume` (a TurnState) continues it. More than `quota` groups
        may end (samples that end while the cut takes effect)."""
        if len(groups) != len(samples):
            raise ValueError(f"{len(groups)} group keys for {len(samples)} samples")
        return self._execute(samples, sampling_params, on_finish, groups, quota)

    def _execute(
        self,
        samples: Sequence[Sample],
        sampling_params: SamplingParams | Sequence[SamplingParams],
        on_finish: Callable[[int, AgentLoopOutput], None] | None,
        groups: Sequence[Any] | None,
        quota: int | None,
    ) -> list[AgentLoopOutput | TurnState]:
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(samples)
        else:
            params = list(sampling_params)
            if len(params) != len(samples):
                raise ValueError(
                    f"{len(params)} sampling params for {len(samples)} samples: need one, or "
                    "one per sample"
                )
        for i, s in enumerate(samples):
            name = s.get("agent_name", self.default_agent)
            if name not in self.agent_loops:
                raise ValueError(
                    f"sample {i}: agent_name={name!r} is not one of {sorted(self.agent_loops)}"
                )
        if self.server.engine.has_unfinished():
            raise RuntimeError("AgentLoopRunner.run needs an idle engine")
        outs: list[AgentLoopOutput | TurnState]
        if not self.server.is_leader:  # a TP peer: the first rank runs the loops
            outs = self.server.follow()
            if len(outs) != len(samples):
                raise RuntimeError(
                    f"the TP group's first rank ran {len(outs)} samples, this rank has "
                    f"{len(samples)}: every rank of a TP group runs the same samples"
                )
            for i, out in enumerate(outs):
                if on_finish is not None and isinstance(out, AgentLoopOutput):
                    on_finish(i, out)
            return outs
        try:
            outs = asyncio.run(self._run(samples, params, on_finish, groups, quota))
        except BaseException as e:
            if self.server.tp_size > 1:
                self.server.tell(("error", f"{type(e).__name__}: {e}"))
                self.server.drain()
            raise
        if self.server.tp_size > 1:
            self.server.tell(("done", outs))
        self.server.release_all()  # turns a loop kept and never continued nor released
        return outs

    async def _run(
        self,
        samples: Sequence[Sample],
        params: Sequence[SamplingParams],
        on_finish: Callable[[int, AgentLoopOutput], None] | None,
        groups: Sequence[Any] | None = None,
        quota: int | None = None,
    ) -> list[AgentLoopOutput | TurnState]:
        done = asyncio.Event()
        self.server.stopping = False
        stepper = asyncio.create_task(self.server.step_until(done))
        left: dict[Any, int] = {}  # a group's samples still running
        for g in groups or ():
            left[g] = left.get(g, 0) + 1
        ended = [0]  # groups whose every sample ended
        if quota is not None and quota <= 0:
            self.server.stop()

        async def one(i: int, sample: Sample) -> AgentLoopOutput | TurnState:
            fields = {k: v for k, v in sample.items() if k != "agent_name"}
            loop = self.agent_loops[sample.get("agent_name", self.default_agent)]
            if "resume" in fields and not loop.resumable:
                raise ValueError(f"sample {i}: its agent loop {type(loop).__name__} cannot resume")
            try:
                out = await loop.run(params[i], sample_index=i, **fields)
            except SampleCut as cut:
                return cut.state
            if on_finish is not None:
                on_finish(i, out)
            if groups is not None and quota is not None:
                left[groups[i]] -= 1
                ended[0] += left[groups[i]] == 0
                if ended[0] >= quota:
                    self.server.stop()
            return out

        tasks = [asyncio.create_task(one(i, s)) for i, s in enumerate(samples)]
        watched: set[asyncio.Task[Any]] = {stepper, *tasks}
        try:
            while tasks and not all(t.done() for t in tasks):
                finished, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                for t in finished:
                    watched.discard(t)
                    if t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                if stepper.done():
                    raise RuntimeError("the engine's step loop ended with samples still running")
            self.server.finish(done)
            await stepper
            return [t.result() for t in tasks]
        except BaseException as e:
            self.server.fail_pending(e)
            for t in [*tasks, stepper]:
                t.cancel()
            await asyncio.gather(*tasks, stepper, return_exceptions=True)
            if self.server.tp_size == 1:  # else `run` tells the peers first
                self.server.drain()
            raise
