"""A multi-turn async rollout rank's groups in flight (`rollout.multi_turn.enable` with
`trainer.mode=async`): each ticket's `n` samples (and each validation prompt) run as agent-loop
samples (`patrl.orchestrator.agent`: the job's tool pool, `tool_agent` or a row's `agent_name`)
over the rank's engine, on the event loop the rollout worker's control loop runs on.

The engine is stepped by `LLMServer.step_until`, one task; the worker's control loop is another
and runs between engine steps, where it pulls newer weights. A sample awaiting its tool holds no
decode slot (its turn is kept, `keep=True`), and the engine decodes the others meanwhile.

Policy versions: every model token records the version that sampled it. A turn starts at the
version loaded when it is submitted; `note_pull` adds a switch point at each unfinished turn's
sampled-token count, as the single-turn worker does per sample. A turn that finished before the
pull (its tokens delivered or about to be) takes no switch: its tokens are all the old
version's. A sample's response versions are its model tokens' versions in sampling order, laid
on the response's mask-1 positions (tokens in, tokens out: the loop appends every sampled token
in order); tool tokens, which no policy sampled, carry the version of the model token before
them, and staleness reads model tokens only.

Migration: each sample's finished turns (ids, logprobs, finish, versions, and a hash of the
conversation they continued) and its tools' answers are recorded as they end (`SampleRecord`)
and go into the rank's flight reports, with the turn open at the report (`OpenTurn`: the
engine's snapshot of it, its tokens so far, their logprobs and its generator state, no KV,
and its version switch points). A peer that adopts the ticket runs the sample's loop again
from its prompt, replaying: a turn whose conversation matches the next recorded one is
answered from the record (no engine work), a tool call from the next recorded answer (the tool
is not called again); the first mismatch ends the replay. The open turn, asked for with its
exact conversation and sampling params, is continued from its snapshot
(`LLMServer.resume_turn`: the conversation and its tokens recomputed, sampling on from the
generator state), so its reported tokens are kept with their versions and only the rest is
sampled. Tool calls that had not answered are made again. Loops must be deterministic given
the same turns and answers, as `ToolAgentLoop` is. See docs/async.md ("Multi-turn tickets").

Interactions (verl's, `rollout.multi_turn.interaction_config_path`) migrate alike: each
`generate_response` answer (its 4-tuple, or its failure: raised or timed out) is recorded as it
comes, beside the tools' answers (`SampleRecord.answers`), and a peer answers the replayed
calls from the record (`RecordingInteractions`: the interaction is not called again for a
recorded answer). `start_interaction` (with the row's kwargs) and `finalize_interaction` run on
the peer as on any rank, so the calls after the record's are live; an interaction whose state
is the conversation (verl's GSM8K) goes on as uninterrupted, one with other per-instance state
has it as `start_interaction` made it (the recorded answers are not fed to it), as the sync
schedule's partial rollouts restart it. The user's tokens, masked out, carry no policy version
of their own (as tool tokens: the model token's before them).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from patrl.orchestrator.agent.agent_loop import (
    AgentLoop,
    AgentLoopContext,
    AgentLoopOutput,
    LLMServer,
    TokenOutput,
)
from patrl.orchestrator.agent.interaction import (
    InteractionCalls,
    InteractionFailed,
    interaction_kwargs,
    load_interactions,
)
from patrl.orchestrator.agent.multi_turn import (
    DEFAULT_AGENT,
    agent_loop_classes,
    agent_name_problems,
    rollout_metrics,
    sample_params_of,
    tools_kwargs,
    turn_scores,
)
from patrl.orchestrator.agent.tool_config import load_tools
from patrl.orchestrator.agent.tool_parser import FunctionCall
from patrl.orchestrator.agent.tool_pool import ToolOutcome, ToolPool
from patrl.orchestrator.async_rl.tickets import token_versions
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.scoring import Trajectory, TrajectoryOutput
from patrl.rollout import Engine, RequestOutput, SamplingParams, SequenceState


@dataclass(slots=True)
class TurnRecord:
    """One finished model turn: a hash of the conversation it continued (`conversation_key`),
    what it sampled, and the version of each sampled token."""

    key: int
    output: TokenOutput
    versions: list[int]


@dataclass(slots=True)
class OpenTurn:
    """A model turn in the engine at a report: its snapshot (`Engine.snapshot_requests`: the
    conversation it continues as its prompt, its tokens so far, their logprobs and its
    generator state; no KV) and its version switch points ((first token sampled with it,
    version), as `InFlight.switches`)."""

    state: SequenceState
    switches: list[tuple[int, int]]

    def tokens(self) -> int:
        return len(self.state.output_token_ids)


@dataclass(slots=True)
class InteractionAnswer:
    """One `generate_response` call's answer as the sample's loop got it: `result`, what
    the call returned (verl's 4-tuple: should_terminate, response text, turn score,
    additional data), or its `failure` ("exception" or "timeout", `InteractionFailed`'s
    kind) with the failure's `message`."""

    result: Any = None
    failure: str | None = None
    message: str = ""

    def replayed(self) -> Any:
        """What the call gives on replay: its result, or its failure raised again."""
        if self.failure is not None:
            raise InteractionFailed(self.failure, self.message)
        return self.result


@dataclass(slots=True)
class SampleRecord:
    """What a peer needs to replay one sample: its finished turns, its tools' answers and its
    interaction's answers, each in order, then the turn open at the report (None: none, or
    its sample awaits a tool or its interaction)."""

    turns: list[TurnRecord] = field(default_factory=list)
    outcomes: list[ToolOutcome] = field(default_factory=list)
    open: OpenTurn | None = None
    answers: list[InteractionAnswer] = field(default_factory=list)

    def tokens(self) -> int:
        """The model tokens recorded, the open turn's included."""
        done = sum(len(t.output.token_ids) for t in self.turns)
        return done + (self.open.tokens() if self.open is not None else 0)


@dataclass(slots=True)
class SampleTrack:
    """One agent-loop sample as it runs: its finished turns, tools' and interaction's
    answers (None: a call not answered yet), what is left to replay of a lost rank's record,
    and every turn it submitted (released when it ends)."""

    turns: list[TurnRecord] = field(default_factory=list)
    outcomes: list[ToolOutcome | None] = field(default_factory=list)
    answers: list[InteractionAnswer | None] = field(default_factory=list)
    replay: SampleRecord = field(default_factory=SampleRecord)
    request_ids: list[str] = field(default_factory=list)
    replayed: int = 0  # model tokens answered from the replayed record

    @property
    def versions(self) -> list[int]:
        """One per model token of its finished turns, in the order they ended."""
        return [v for t in self.turns for v in t.versions]

    def record(self, ended: Sequence[TurnRecord], open_turn: OpenTurn | None) -> SampleRecord:
        """Its turns, then `ended` (turns the engine finished that the sample has not taken
        yet), and its tools' and interaction's answers up to the first call not answered yet;
        then `open_turn` unless a call is unanswered (what follows such a call is not
        replayed). What is left to replay of a lost rank's record (all of it, until the
        sample first runs) comes after its own: it is still this sample's."""
        answered = self.outcomes.index(None) if None in self.outcomes else len(self.outcomes)
        outcomes = [o for o in self.outcomes[:answered] if o]
        told = self.answers.index(None) if None in self.answers else len(self.answers)
        answers = [a for a in self.answers[:told] if a]
        if answered < len(self.outcomes) or told < len(self.answers):
            open_turn = None
        left = self.replay
        return SampleRecord(
            [*self.turns, *ended, *left.turns],
            outcomes + left.outcomes,
            open_turn if open_turn is not None else left.open,
            answers + left.answers,
        )

    def stop_replay(self) -> None:
        self.replay = SampleRecord()


def conversation_key(prompt_ids: Sequence[int]) -> int:
    """A turn's conversation, hashed (Python's hash of a tuple of ints is the same in every
    process): a replayed turn must continue exactly the conversation its record did."""
    return hash(tuple(prompt_ids))


# The sample whose `run` is executing: each sample's task runs in a context of its own.
_CURRENT: contextvars.ContextVar[SampleTrack | None] = contextvars.ContextVar(
    "patrl_agent_sample", default=None
)


class VersionedServer(LLMServer):
    """An `LLMServer` (TP 1) that records the policy version of every token its samples'
    turns sample (`SampleTrack`), for agent loops that stay oblivious of versions, and
    continues a lost rank's open turn from its snapshot (`SampleRecord.open`)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine, keep_kv=True)
        # Turns submitted and not yet returned, by request id: their switch points ((first
        # token sampled with it, version), as `InFlight.switches`), their conversation's key,
        # and, once the engine finished them, their record (until their sample takes it).
        self.switches: dict[str, list[tuple[int, int]]] = {}
        self.keys: dict[str, int] = {}
        self.ended: dict[str, TurnRecord] = {}
        self.events = 0  # turns ended and tool answers recorded: a report would differ

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
        track = _CURRENT.get()
        key = conversation_key(prompt_ids)
        if track is not None and track.replay.turns:
            if track.replay.turns[0].key == key:
                turn = track.replay.turns.pop(0)
                track.turns.append(turn)
                track.replayed += len(turn.output.token_ids)
                return dataclasses.replace(turn.output)
            track.stop_replay()  # the loop went another way: generate from here on
        resumed: OpenTurn | None = None
        if track is not None and track.replay.open is not None:
            resumed, track.replay.open = track.replay.open, None
            if resumed.state.prompt_token_ids != list(prompt_ids) or (
                resumed.state.params != sampling_params
            ):
                resumed = None  # not the turn the record holds: generate it afresh
                track.stop_replay()
        if track is None:
            return await super().generate(
                request_id,
                prompt_ids=prompt_ids,
                sampling_params=sampling_params,
                keep=keep,
                continues=continues,
                resumable=resumable,
            )
        version = self.engine.weight_version
        if resumed is None:
            switches = [(0, version)]
        else:  # the reported points, then this engine's version from its first new token
            switches = [*resumed.switches, (resumed.tokens(), version)]
        track.request_ids.append(request_id)
        self.switches[request_id], self.keys[request_id] = switches, key
        try:
            if resumed is None:
                await super().generate(
                    request_id,
                    prompt_ids=prompt_ids,
                    sampling_params=sampling_params,
                    keep=keep,
                    continues=continues,
                    resumable=resumable,
                )
            else:
                if continues is not None:
                    self.release(continues)  # its conversation goes on in the resumed turn
                state = dataclasses.replace(resumed.state, request_id=request_id)
                await self.resume_turn(state, keep=keep)
                track.replayed += resumed.tokens()
        finally:
            self.switches.pop(request_id, None)
            self.keys.pop(request_id, None)
            record = self.ended.pop(request_id, None)
        assert record is not None, f"turn {request_id!r} returned without the engine ending it"
        track.turns.append(record)
        self.events += 1
        return dataclasses.replace(record.output)

    def turn_ended(self, out: RequestOutput) -> None:
        """Record a tracked turn the engine finished (its sample takes the record when it
        runs; a report made before that holds it among the sample's finished turns)."""
        switches = self.switches.get(out.request_id)
        if switches is None:
            return
        seq = out.outputs[0]
        output = TokenOutput(
            list(seq.token_ids), list(seq.logprobs), seq.finish_reason, seq.stop_reason
        )
        versions = token_versions(switches, len(output.token_ids))
        self.ended[out.request_id] = TurnRecord(self.keys[out.request_id], output, versions)

    def in_flight(
        self, track: SampleTrack, running: set[str]
    ) -> tuple[list[TurnRecord], OpenTurn | None]:
        """`track`'s turns the engine finished that its sample has not taken yet, and its
        turn in the engine now (snapshot and switch points copied; None if none).
        `running`: the engine's unfinished request ids."""
        ended, open_turn = [], None
        for rid in track.request_ids:
            if rid in self.ended:
                ended.append(self.ended[rid])
            elif rid in self.switches and rid in running and open_turn is None:
                (state,) = self.engine.snapshot_requests([rid])
                open_turn = OpenTurn(state, list(self.switches[rid]))
        return ended, open_turn

    def note_pull(self, version: int) -> None:
        """Weights `version` are being loaded (between engine steps): tokens the unfinished
        turns sample from here on are that version's."""
        for seq in self.engine.unfinished_seqs():
            switches = self.switches.get(seq.request_id)
            if switches is not None:
                switches.append((len(seq.output_token_ids), version))


class RecordingPool(ToolPool):
    """A `ToolPool` that records each sample's answers in call order, and answers a replayed
    sample's calls from its record (the tool is not called again)."""

    def __init__(self, tools: Sequence[Any], **kwargs: Any) -> None:
        super().__init__(tools, **kwargs)
        self.events = 0  # answers recorded

    async def call(
        self, call: FunctionCall, create_kwargs: Mapping[str, Any] | None = None
    ) -> ToolOutcome:
        track = _CURRENT.get()
        if track is None:
            return await super().call(call, create_kwargs)
        if track.replay.outcomes:
            outcome = track.replay.outcomes.pop(0)
            track.outcomes.append(outcome)
            return outcome
        track.stop_replay()  # a call made anew: nothing recorded after it applies
        slot = len(track.outcomes)
        track.outcomes.append(None)  # reserved in call order: calls run concurrently
        outcome = await super().call(call, create_kwargs)
        track.outcomes[slot] = outcome
        self.events += 1
        return outcome


class RecordingInteractions(InteractionCalls):
    """The agent loops' interaction calls (`ToolAgentLoop.interaction_calls`) on an async
    rollout rank: each `generate_response` answer of a sample is recorded in call order
    (`SampleTrack.answers`), and a replayed sample's calls are answered from its record (the
    interaction is not called again). `start_interaction` and `finalize_interaction` always
    run (a peer's later live calls need the instance)."""

    def __init__(self) -> None:
        self.events = 0  # answers recorded

    async def call(self, what: str, make: Any, timeout_s: float) -> Any:
        track = _CURRENT.get()
        if track is None or what != "generate_response":
            return await super().call(what, make, timeout_s)
        if track.replay.answers:
            answer = track.replay.answers.pop(0)
            track.answers.append(answer)
            return answer.replayed()
        track.stop_replay()  # a call made anew: nothing recorded after it applies
        slot = len(track.answers)
        track.answers.append(None)  # not answered yet: a report holds nothing after it
        try:
            result = await super().call(what, make, timeout_s)
        except InteractionFailed as e:
            track.answers[slot] = InteractionAnswer(failure=e.kind, message=str(e))
            self.events += 1
            raise
        track.answers[slot] = InteractionAnswer(picklable_answer(result))
        self.events += 1
        return result


def picklable_answer(result: Any) -> Any:
    """`result` as a flight report can hold it: itself where it pickles; else a 4-tuple with
    its additional data dropped (the loop reads the other three only: should_terminate's
    truth, the text's str, the score's float), else None (not a 4-tuple: the loop ends the
    sample on either, as on a malformed answer)."""
    try:
        pickle.dumps(result)
        return result
    except Exception:
        pass
    if isinstance(result, tuple) and len(result) == 4:
        terminate, content, score, _ = result
        try:
            kept: tuple[Any, ...] = (
                bool(terminate),
                str(content),
                None if score is None else float(score),
                {},
            )
        except (TypeError, ValueError):
            return None
        return kept
    return None


@dataclass(slots=True)
class FinishedGroup:
    """A group whose samples all ended: the trajectories (`score_outputs` reads them), each
    response token's policy version, the group's `multi_turn/*` counters, and its model
    tokens replayed from a lost rank's record."""

    key: str
    item: PromptItem
    output: TrajectoryOutput
    versions: list[list[int]]
    metrics: dict[str, float]
    replayed: int = 0


@dataclass(slots=True)
class _Group:
    item: PromptItem
    tasks: list[asyncio.Task[AgentLoopOutput]]
    tracks: list[SampleTrack]
    left: int  # samples not ended yet


class AgentGroups:
    """Groups of agent-loop samples in flight over one engine (TP 1), keyed by the caller
    (a ticket's request id, a validation request's). `start` needs the running event loop;
    `finished` hands back whole groups as their last sample ends; `check` raises what a
    sample or the engine's step task raised (the job fails, never hangs)."""

    def __init__(self, config: JobConfig, engine: Engine) -> None:
        mt = config.rollout.multi_turn
        if mt.tool_config_path is None and mt.interaction_config_path is None:
            raise ValueError(
                "rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path or "
                "rollout.multi_turn.interaction_config_path"
            )
        if engine.layout.tp_size != 1:
            raise ValueError(
                f"async multi-turn samples run on a tp=1 engine (each rollout rank its own); "
                f"this one has tp={engine.layout.tp_size}"
            )
        self.engine = engine
        self.tokenizer: Any = engine.tokenizer
        self.response_length = config.data.max_response_length
        self.interactions = (
            {}
            if mt.interaction_config_path is None
            else load_interactions(mt.interaction_config_path)
        )
        self.calls = RecordingInteractions()
        self.pool = RecordingPool(
            [] if mt.tool_config_path is None else load_tools(mt.tool_config_path),
            timeout_s=mt.tool_timeout_s,
            max_response_length=mt.max_tool_response_length,
            truncate_side=mt.tool_response_truncate_side,
        )
        self.context = AgentLoopContext(
            self.tokenizer,
            self.pool,
            tuple(sorted(engine.eos_token_ids)),
            self.response_length,
            mt,
            self.interactions,
        )
        self.classes = agent_loop_classes(config)
        self.server = VersionedServer(engine)
        self.loops: dict[str, AgentLoop] = {}
        self.groups: dict[str, _Group] = {}
        self.dropped: set[str] = set()  # run out, their results not wanted
        self.ended: list[str] = []  # groups whose samples all ended, not yet `finished`
        self.failure: BaseException | None = None  # the first sample's loop that raised
        self.stepper: asyncio.Task[None] | None = None

    def start(
        self,
        key: str,
        item: PromptItem,
        params: SamplingParams,
        replay: Sequence[SampleRecord] | None = None,
    ) -> None:
        """Run `item`'s `params.n` samples, sample k seeded as the sync schedule seeds it
        (`MultiTurnRollout`), so both schedules sample the same tokens from the same weights;
        sample k replays `replay[k]` first (a lost rank's record, `records`)."""
        if key in self.groups:
            raise ValueError(f"group {key!r} is already in flight")
        if self.stepper is None:  # first, so that step_until readies the server first
            self.stepper = asyncio.get_running_loop().create_task(
                self.server.step_until(asyncio.Event())
            )
        name, fields = self._row(item)
        loop = self._loop(name, item)
        tasks, tracks = [], []
        for k, p in enumerate(sample_params(params)):
            track = SampleTrack()
            if replay is not None:
                r = replay[k]
                track.replay = SampleRecord(
                    list(r.turns), list(r.outcomes), r.open, list(r.answers)
                )
            # The task copies the context it is made in: the one where `track` is current.
            context = contextvars.copy_context()
            context.run(_CURRENT.set, track)
            run = loop.run(p, sample_index=k, **fields)
            task = context.run(asyncio.get_running_loop().create_task, run)
            task.add_done_callback(functools.partial(self._sample_ended, key))
            tasks.append(task)
            tracks.append(track)
        self.groups[key] = _Group(item, tasks, tracks, len(tasks))

    def _sample_ended(self, key: str, task: asyncio.Task[AgentLoopOutput]) -> None:
        """A sample's task is done: note a failure, or its group's end once all are done."""
        group = self.groups.get(key)
        if task.cancelled() or group is None or task not in group.tasks:
            return  # cancelled by `close`, or a group of an engine since dropped
        error = task.exception()
        if error is not None and self.failure is None:
            self.failure = error
        group.left -= 1
        if group.left == 0:
            self.ended.append(key)

    def records(self, key: str) -> list[SampleRecord]:
        """What a peer needs to replay group `key`'s samples (`start(..., replay=)`): their
        finished turns, answers and open turns as they stand now."""
        running = set(self.engine.request_ids())
        return [t.record(*self.server.in_flight(t, running)) for t in self.groups[key].tracks]

    @property
    def events(self) -> int:
        """Counts every turn ended and tool or interaction answer recorded: a report made at
        a different count would hold more."""
        return self.server.events + self.pool.events + self.calls.events

    def live(self) -> bool:
        """Whether a sample is running (generating, or awaiting its tool)."""
        return bool(self.groups)

    def drop(self, key: str) -> None:
        """Forget `key`'s results: its samples run to their end (a turn in the engine cannot
        be taken from its waiting sample safely), then are discarded."""
        if key in self.groups:
            self.dropped.add(key)

    def check(self) -> None:
        """Raise the failure of the engine's step task or of a sample's loop, if any."""
        if self.stepper is not None and self.stepper.done():
            error = None if self.stepper.cancelled() else self.stepper.exception()
            if error is not None:
                raise error
            raise RuntimeError("the engine's step task ended while samples ran")
        if self.failure is not None:
            raise self.failure

    def finished(self) -> list[FinishedGroup]:
        """The groups whose samples all ended since the last call (dropped ones discarded),
        in the order they ended; their kept turns are released."""
        self.check()
        out = []
        ended, self.ended = self.ended, []
        for key in ended:
            group = self.groups.pop(key)
            for track in group.tracks:
                for turn in track.request_ids:
                    self.server.release(turn)  # ignored unless still kept
            if key in self.dropped:
                self.dropped.discard(key)
                continue
            outs = [t.result() for t in group.tasks]
            versions = [
                response_versions(o.response_mask, tr.versions)
                for o, tr in zip(outs, group.tracks, strict=True)
            ]
            output = self._output(key, outs)
            out.append(
                FinishedGroup(
                    key,
                    group.item,
                    output,
                    versions,
                    rollout_metrics(outs),
                    sum(t.replayed for t in group.tracks),
                )
            )
        return out

    def close(self) -> None:
        """Cancel every sample and the step task (the engine is being dropped)."""
        for group in self.groups.values():
            for t in group.tasks:
                t.cancel()
        if self.stepper is not None:
            self.stepper.cancel()
        self.groups, self.dropped, self.ended, self.stepper = {}, set(), [], None

    # ---------------------------------------------------------------- helpers

    def _row(self, item: PromptItem) -> tuple[str, dict[str, Any]]:
        """The agent loop `item` names and the fields its `run` receives."""
        fields: dict[str, Any] = {"raw_prompt": item.messages}
        kwargs = tools_kwargs(item)
        if kwargs:
            fields["tools_kwargs"] = kwargs
        ikwargs = interaction_kwargs(item.extra)
        if ikwargs is not None:
            fields["interaction_kwargs"] = ikwargs
        name = item.extra.get("agent_name")
        return (DEFAULT_AGENT if name is None else name), fields

    def _loop(self, name: str, item: PromptItem) -> AgentLoop:
        if name not in self.loops:
            problems = agent_name_problems([item], self.classes)
            if problems:
                raise ValueError("; ".join(problems))
            loop = self.classes[name].build(self.context)
            loop.server_manager = self.server
            if isinstance(getattr(loop, "interaction_calls", None), InteractionCalls):
                loop.interaction_calls = self.calls  # type: ignore[attr-defined]
            self.loops[name] = loop
        return self.loops[name]

    def _output(self, key: str, outs: list[AgentLoopOutput]) -> TrajectoryOutput:
        trajectories = [
            Trajectory(
                k,
                list(o.response_ids),
                list(o.response_logprobs),
                "length" if len(o.response_ids) >= self.response_length else "stop",
                str(self.tokenizer.decode(o.response_ids, skip_special_tokens=True)),
                list(o.response_mask),
                turn_scores(o),
            )
            for k, o in enumerate(outs)
        ]
        return TrajectoryOutput(key, list(outs[0].prompt_ids), trajectories)


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """One group's per-sample params: n=1 each, sample k seeded as `MultiTurnRollout` seeds
    it (`multi_turn.sample_params_of`)."""
    return [sample_params_of(params, k) for k in range(params.n)]


def response_versions(mask: Sequence[int], model_versions: Sequence[int]) -> list[int]:
    """One version per response token: the model tokens' (mask 1) in order; a tool token
    (mask 0) the model token's before it (the first model token's at the start). ValueError
    when the mask's model tokens are not the tokens the sample's turns sampled."""
    if sum(1 for m in mask if m) != len(model_versions):
        raise ValueError(
            f"an agent loop's response_mask has {sum(1 for m in mask if m)} model tokens, but "
            f"its turns sampled {len(model_versions)}: AgentLoopOutput must hold every sampled "
            "token, in order, with mask 1 (tokens in, tokens out)"
        )
    out: list[int] = []
    it = iter(model_versions)
    last = model_versions[0] if model_versions else 0
    for m in mask:
        if m:
            last = next(it)
        out.append(last)
    return out
