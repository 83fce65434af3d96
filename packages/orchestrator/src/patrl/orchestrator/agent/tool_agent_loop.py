"""verl's ToolAgentLoop on patrl's engine: the model turn ends at the end of the assistant's
turn (EOS) or at `</tool_call>`; the turn's calls are parsed (hermes), run in the tool pool,
and their answers rendered by the tokenizer's chat template as tool messages and appended as
token ids; then the model goes on, until a turn without calls, `max_assistant_turns`,
`max_user_turns`, `response_length` tokens, or a tool turn that would leave the engine's
max_model_len no room.

Tokens in, tokens out: the trajectory is exactly the sampled ids plus the appended ids; model
text is decoded only to find the calls, never encoded again. The appended ids are the
template's rendering of what follows the model's turn: the end of the assistant's turn (less
the EOS the model sampled), the tool messages, and the next assistant turn's opening.

Resumable (partial rollouts): the sample's whole state lives in a `TurnState`, so a cut
(`TurnCut`) raises `SampleCut` with it, and `run(..., resume=state)` goes on from it: the
turn in the engine at the cut continues from its exported state (`LLMServer.resume_turn`), a
sample cut between turns starts its next turn over the conversation so far (re-prefilled; a
tool call in progress at the cut had finished and its answer was appended, so no call runs
twice). A resumed trajectory is the same ids as an uncut one under the same weights.

Interactions (verl's, `interaction.BaseInteraction`): a row with `interaction_kwargs` names
one; after a model turn without a tool call, the interaction's `generate_response` reads the
conversation as messages (the model's turns decoded, the tool messages as appended) and, unless
it ends the conversation, its answer is appended as a user message's tokens (mask 0, the KV
extended as for tool turns) and counts a user turn; its turn scores are the output's
`extra_fields["turn_scores"]`. A `generate_response` that raises, passes its deadline or
answers other than verl's 4-tuple ends the sample there, a `start_interaction` that fails
leaves the sample without its interaction (both counted in `interaction_errors`);
`finalize_interaction` runs once the sample ends, is cut, or fails. A cut sample's interaction is finalized, and started again under the
same instance id at its resume: the conversation so far is in its TurnState's `messages`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import uuid4

from patrl.orchestrator.agent.agent_loop import (
    AgentLoop,
    AgentLoopContext,
    AgentLoopOutput,
    SampleCut,
    TokenOutput,
    TurnCut,
    TurnState,
    register,
)
from patrl.orchestrator.agent.interaction import (
    BaseInteraction,
    InteractionCalls,
    InteractionFailed,
    interaction_row_problem,
)
from patrl.orchestrator.agent.tool_parser import TOOL_CALL_END, extract_tool_calls
from patrl.orchestrator.agent.tool_pool import ToolOutcome, ToolPool
from patrl.rollout import SamplingParams

_MARK = "\x00patrl-assistant-turn\x00"
METRICS = ("tool_calls", "tool_errors", "tool_truncated", "tool_exceptions", "tool_timeouts")
# a sample with an interaction also counts these: user turns it answered, its calls that
# raised or passed their deadline (either ends the sample), and the timeouts among them; and,
# for `tool_guard.ToolFailureGuard`, the answers it asked for (each generate_response call,
# and a start_interaction that failed: the sample asks nothing more) and how many of those
# failed (raised, timed out, or not verl's 4-tuple)
INTERACTION_METRICS = (
    "interaction_turns",
    "interaction_errors",
    "interaction_timeouts",
    "interaction_calls",
    "interaction_failures",
)
_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]


@register("tool_agent")
class ToolAgentLoop(AgentLoop):
    """verl's `tool_agent` loop. `pool` holds the tools; the keys are verl's
    `rollout.multi_turn.*` (0 turns = no limit) and `response_length` (model and tool tokens
    of a trajectory, verl's rollout.response_length). `eos_token_ids`: the ids that end an
    assistant turn (the engine's). `stop_at_tool_call`: end a model turn at `</tool_call>`
    (one call a turn; off: at EOS only, verl's way, several calls a turn). `interactions`:
    verl's interactions by name (a row's `interaction_kwargs.name` picks one), each call
    under `interaction_timeout_s`."""

    resumable = True

    def __init__(
        self,
        tokenizer: Any,
        pool: ToolPool,
        eos_token_ids: Sequence[int],
        response_length: int,
        max_assistant_turns: int | None = None,
        max_user_turns: int | None = None,
        max_parallel_calls: int = 1,
        format: str = "hermes",
        stop_at_tool_call: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        interactions: Mapping[str, BaseInteraction] | None = None,
        interaction_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(tokenizer)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tool agent loop needs a tokenizer with a chat template")
        if response_length < 1 or max_parallel_calls < 1:
            raise ValueError(
                f"response_length ({response_length}) and max_parallel_calls "
                f"({max_parallel_calls}) must be >= 1"
            )
        extract_tool_calls("", format)  # names an unsupported format now
        self.pool = pool
        self.eos_token_ids = frozenset(eos_token_ids)
        self.response_length = response_length
        self.max_assistant_turns = max_assistant_turns
        self.max_user_turns = max_user_turns
        self.max_parallel_calls = max_parallel_calls
        self.format = format
        self.stop_at_tool_call = stop_at_tool_call
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.interactions = dict(interactions or {})
        if interaction_timeout_s <= 0:
            raise ValueError(f"interaction_timeout_s must be > 0, got {interaction_timeout_s}")
        self.interaction_timeout_s = interaction_timeout_s
        self.interaction_calls = InteractionCalls()  # the async schedule's records its answers
        self.tool_schemas = [
            t.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
            for t in pool.tools.values()
        ]
        self._base = self._render(_BASE, add_generation_prompt=False)
        self._closing = self._base[self._base.rindex(_MARK) + len(_MARK) :]

    @classmethod
    def build(cls, context: AgentLoopContext) -> ToolAgentLoop:
        """The job's tool loop: its tool pool, budget and `rollout.multi_turn` limits."""
        mt = context.multi_turn
        return cls(
            context.tokenizer,
            context.tool_pool,
            context.eos_token_ids,
            response_length=context.response_length,
            max_assistant_turns=mt.max_assistant_turns,
            max_user_turns=mt.max_user_turns,
            max_parallel_calls=mt.max_parallel_calls,
            format=mt.format,
            interactions=context.interactions,
            interaction_timeout_s=mt.tool_timeout_s,
        )

    # ------------------------------------------------------------------ run

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        """One sample: `raw_prompt` (its chat messages), optional `tools_kwargs` (verl's:
        per tool name, {"create_kwargs": {...}}), `sample_index` (names its requests), and
        `resume`, a `TurnState` of this sample from a partial rollout's cut (its own sampling
        params are used then), `interaction_kwargs` (verl's: `name` picks the interaction, all
        of it goes to `start_interaction`). SampleCut (with the sample's TurnState) when a cut
        stops it; ValueError for interaction_kwargs without a configured interaction's name."""
        tools_kwargs: Mapping[str, Any] = kwargs.get("tools_kwargs") or {}
        resume: TurnState | None = kwargs.get("resume")
        ikwargs: dict[str, Any] | None = kwargs.get("interaction_kwargs")
        interaction: BaseInteraction | None = None
        if ikwargs is not None and self.interactions:
            problem = interaction_row_problem(ikwargs, list(self.interactions))
            if problem is not None:
                raise ValueError(f"sample {kwargs.get('sample_index', 0)}: {problem}")
            interaction = self.interactions[ikwargs["name"]]
        if resume is None:
            st = TurnState(
                self.prompt_ids(kwargs["raw_prompt"]),
                [],
                [],
                [],
                0,
                0,
                dict.fromkeys(METRICS, 0),
                sampling_params,
                f"agent-{kwargs.get('sample_index', 0)}-{uuid4().hex[:8]}",
            )
        else:  # a copy: the caller's state stays as it was saved
            st = dataclasses.replace(
                resume,
                response_ids=list(resume.response_ids),
                response_mask=list(resume.response_mask),
                response_logprobs=list(resume.response_logprobs),
                metrics=dict(resume.metrics),
                # getattr: a state saved before TurnState had these fields has none
                messages=[dict(m) for m in getattr(resume, "messages", None) or ()] or None,
                turn_scores=list(getattr(resume, "turn_scores", None) or ()),
            )
        started = False
        if interaction is not None:
            assert ikwargs is not None
            for key in INTERACTION_METRICS:
                st.metrics.setdefault(key, 0)
            if st.messages is None:
                st.messages = [dict(m) for m in kwargs["raw_prompt"]]
            started = await self._interaction_call(
                st,
                "start_interaction",
                lambda: interaction.start_interaction(st.request, **ikwargs),
            )
            if not started:  # no answer will come: a failed ask for the failure guard
                st.metrics["interaction_calls"] += 1
                st.metrics["interaction_failures"] += 1
        try:
            await self._go_on(st, tools_kwargs, interaction if started else None, ikwargs or {})
        except TurnCut as cut:
            st.open_turn = cut.open_turn
            raise SampleCut(st) from None
        finally:
            if started:
                assert interaction is not None
                await self._interaction_call(
                    st,
                    "finalize_interaction",
                    lambda: interaction.finalize_interaction(st.request),
                )
        extra: dict[str, Any] = {}
        if interaction is not None:
            extra["turn_scores"] = list(st.turn_scores)  # verl's AgentLoopOutput field
            extra["interaction"] = ikwargs["name"] if ikwargs else None  # the guard's name
        return AgentLoopOutput(
            prompt_ids=list(st.prompt_ids),
            response_ids=st.response_ids,
            response_mask=st.response_mask,
            response_logprobs=st.response_logprobs,
            num_turns=st.user_turns + st.assistant_turns + 1,
            metrics=dict(st.metrics),
            extra_fields=extra,
        )

    async def _interaction_call(self, st: TurnState, what: str, make: Any) -> Any:
        """One interaction call of sample `st` (`interaction.call_interaction`); its result,
        or False when it raised or passed its deadline (counted in the sample's metrics)."""
        try:
            result = await self.interaction_calls.call(what, make, self.interaction_timeout_s)
            return result or True
        except InteractionFailed as e:
            st.metrics["interaction_errors"] = st.metrics.get("interaction_errors", 0) + 1
            if e.kind == "timeout":
                st.metrics["interaction_timeouts"] = st.metrics.get("interaction_timeouts", 0) + 1
            return False

    async def _go_on(
        self,
        st: TurnState,
        tools_kwargs: Mapping[str, Any],
        interaction: BaseInteraction | None = None,
        ikwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Run the conversation of `st` to its end, updating `st` as each turn ends (so that
        on TurnCut it is the state to resume from). `interaction` (started): answers the
        turns without calls."""
        ids = st.prompt_ids + st.response_ids
        previous: str | None = None  # the last turn, kept in the engine with its KV
        try:
            while True:
                if st.open_turn is not None:  # the turn a cut stopped, resumed
                    open_turn, st.open_turn = st.open_turn, None
                    try:
                        turn = await self.server_manager.resume_turn(open_turn, keep=True)
                    except TurnCut as cut:
                        raise TurnCut(cut.open_turn or open_turn) from None
                    previous = open_turn.request_id  # kept: the next turn extends its KV
                else:
                    params = self._turn_params(
                        st.sampling_params, len(st.response_mask), st.assistant_turns
                    )
                    turn_id = f"{st.request}-{st.assistant_turns}"
                    turn = await self.server_manager.generate(
                        turn_id,
                        prompt_ids=ids,
                        sampling_params=params,
                        keep=True,
                        continues=previous,
                        resumable=True,
                    )
                    previous = turn_id
                ids += turn.token_ids
                st.response_ids += turn.token_ids
                st.response_mask += [1] * len(turn.token_ids)
                st.response_logprobs += turn.log_probs
                st.assistant_turns += 1
                if len(st.response_mask) >= self.response_length:
                    break
                if self.max_assistant_turns and st.assistant_turns >= self.max_assistant_turns:
                    break
                if self.max_user_turns and st.user_turns >= self.max_user_turns:
                    break
                text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=False)
                _, parsed = extract_tool_calls(text, self.format)
                if st.messages is not None and interaction is not None:
                    content = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
                    st.messages.append({"role": "assistant", "content": str(content)})
                if not parsed:
                    if interaction is None:
                        break
                    appended = await self._user_turn(st, interaction, ikwargs or {}, turn)
                    if appended is None or (
                        len(st.response_mask) + len(appended) >= self.response_length
                        or len(ids) + len(appended) >= self.server_manager.max_model_len
                    ):
                        break  # as for tool turns: never ends on a user turn
                    ids += appended
                    st.response_ids += appended
                    st.response_mask += [0] * len(appended)
                    st.response_logprobs += [0.0] * len(appended)
                    st.user_turns += 1
                    st.metrics["interaction_turns"] += 1
                    continue
                outcomes = await asyncio.gather(
                    *(
                        self.pool.call(
                            c, (tools_kwargs.get(c.name or "") or {}).get("create_kwargs")
                        )
                        for c in parsed[: self.max_parallel_calls]
                    )
                )
                m = st.metrics
                m["tool_calls"] += len(outcomes)
                m["tool_errors"] += sum(o.error is not None for o in outcomes)
                m["tool_truncated"] += sum(o.truncated for o in outcomes)
                m["tool_exceptions"] += sum(o.error == "exception" for o in outcomes)
                m["tool_timeouts"] += sum(o.error == "timeout" for o in outcomes)
                appended = self.tool_turn_ids(outcomes, self._ended_with_eos(turn))
                if (
                    len(st.response_mask) + len(appended) >= self.response_length
                    or len(ids) + len(appended) >= self.server_manager.max_model_len
                ):
                    break  # verl's rule: the trajectory never ends on a tool turn
                ids += appended
                st.response_ids += appended
                st.response_mask += [0] * len(appended)
                st.response_logprobs += [0.0] * len(appended)
                st.user_turns += 1
                if st.messages is not None and interaction is not None:
                    st.messages += [{"role": "tool", "content": o.text} for o in outcomes]
        except TurnCut:
            if previous is not None:
                self.server_manager.release(previous)  # its KV is not kept across a cut
            raise
        if previous is not None:
            self.server_manager.release(previous)  # the conversation ends here

    async def _user_turn(
        self,
        st: TurnState,
        interaction: BaseInteraction,
        ikwargs: Mapping[str, Any],
        turn: TokenOutput,
    ) -> list[int] | None:
        """The interaction's answer to the conversation `st.messages` as the ids to append
        (the assistant turn's closing, the user message, the next turn's opening), its turn
        score kept; None when it ends the conversation or its call failed."""
        messages = [dict(m) for m in st.messages or ()]
        result = await self._interaction_call(
            st,
            "generate_response",
            lambda: interaction.generate_response(st.request, messages, **ikwargs),
        )
        st.metrics["interaction_calls"] += 1
        if result is False:
            st.metrics["interaction_failures"] += 1
            return None
        try:
            terminate, content, score, _ = result
            score = None if score is None else float(score)
        except (TypeError, ValueError):
            st.metrics["interaction_errors"] += 1
            st.metrics["interaction_failures"] += 1
            return None  # not verl's 4-tuple of a number: ends as a raising call does
        if score is not None:
            st.turn_scores.append(score)
        if terminate:
            return None
        message = {"role": "user", "content": str(content)}
        ids = self.appended_ids([message], self._ended_with_eos(turn))
        assert st.messages is not None
        st.messages.append(message)
        return ids

    # -------------------------------------------------------- chat template

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt: `messages` rendered with the tools' schemas and the assistant's turn
        opened, encoded once."""
        text = self._render(messages, add_generation_prompt=True, tools=self.tool_schemas or None)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tool_turn_ids(self, outcomes: Sequence[ToolOutcome], ended_with_eos: bool) -> list[int]:
        """What the template puts after a model turn that made calls: the rest of the
        assistant's turn (its closing, less the EOS the model sampled), one tool message per
        answer, and the next assistant turn's opening; encoded without special tokens added."""
        tool_messages = [{"role": "tool", "content": o.text} for o in outcomes]
        return self.appended_ids(tool_messages, ended_with_eos)

    def appended_ids(
        self, messages: Sequence[Mapping[str, Any]], ended_with_eos: bool
    ) -> list[int]:
        """What the template puts after a model turn followed by `messages` (tool or user
        messages): the rest of the assistant's turn (less the EOS the model sampled), the
        messages, and the next assistant turn's opening; encoded without special tokens."""
        full = self._render([*_BASE, *messages], add_generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError(
                "the chat template renders a conversation followed by tool or user messages so "
                "that it no longer starts with the conversation's own rendering; such turns "
                "cannot be appended as tokens with it"
            )
        closing = self._closing
        if ended_with_eos:
            eos_text = self._eos_text(closing)
            closing = closing[len(eos_text) :]
        return list(
            self.tokenizer.encode(closing + full[len(self._base) :], add_special_tokens=False)
        )

    def _eos_text(self, closing: str) -> str:
        """The text of the EOS token that opens the turn's closing ("" if none does)."""
        for t in self.eos_token_ids:
            text = self.tokenizer.decode([t], skip_special_tokens=False)
            if text and closing.startswith(text):
                return str(text)
        return ""

    def _render(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, **kwargs, **self.template_kwargs
            )
        )

    # ---------------------------------------------------------------- turns

    def _turn_params(self, params: SamplingParams, used: int, turn: int) -> SamplingParams:
        """This turn's params: at most the response budget left, one sample, stopping at the
        end of a call; a seeded sample draws turn t from seed + t."""
        stop = tuple(params.stop)
        stop_ids = set(params.stop_token_ids)
        if self.stop_at_tool_call:
            stop += (TOOL_CALL_END,) if TOOL_CALL_END not in stop else ()
            end = self.tokenizer.encode(TOOL_CALL_END, add_special_tokens=False)
            if len(end) == 1:  # a special token that decoding might hide
                stop_ids.add(end[0])
        return dataclasses.replace(
            params,
            n=1,
            max_tokens=max(1, min(params.max_tokens, self.response_length - used)),
            stop=stop,
            stop_token_ids=frozenset(stop_ids),
            seed=None if params.seed is None else (params.seed + turn) % (1 << 62),
        )

    def _ended_with_eos(self, turn: TokenOutput) -> bool:
        return (
            turn.finish_reason == "stop"
            and bool(turn.token_ids)
            and turn.token_ids[-1] in self.eos_token_ids
        )
