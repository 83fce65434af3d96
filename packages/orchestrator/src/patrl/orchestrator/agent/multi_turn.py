"""The training loop's multi-turn rollout (`rollout.multi_turn.enable`): a replica's prompts run
through `AgentLoopRunner` + `ToolAgentLoop` on its engine instead of `Engine.generate`, and come
back as `scoring.TrajectoryOutput`s, one per prompt, for `scoring.score_outputs`.

Each prompt's chat messages (`PromptItem.messages`) are the conversation, its row's
`extra_info.tools_kwargs` (verl's) the tools' create kwargs, its row's `agent_name` (verl's)
the registered agent loop it runs (`tool_agent` when it has none; `single_turn_agent` is
built in, and `rollout.agent.agent_loop_config_path` adds a job's own); its `n` samples are
separate agent-loop samples, sample k seeded from the prompt's seed and k (so a group's samples
differ and a rerun samples the same tokens). The trajectory is exactly the engine's tokens and
the appended tool tokens; the reward sees their decoding.

Partial rollouts (`generate_partial`, `rollout.over_sample_rate > 0`): a group (a prompt's n
samples) is carried from step to step as one entry per sample, its AgentLoopOutput once it
ended, else its `TurnState`; the step ends once its quota of groups ended.

Interactions (`rollout.multi_turn.interaction_config_path`, verl's): a row's
`extra_info.interaction_kwargs` names the interaction that answers its final turns; the
interaction's turn scores reach the reward functions as verl passes them, `turn_scores` in the
row's `extra_info` (and as a top-level `turn_scores` for patrl's keyword functions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from patrl.orchestrator.agent.agent_loop import (
    AgentLoop,
    AgentLoopContext,
    AgentLoopOutput,
    AgentLoopRunner,
    TurnState,
    registered_agent_loops,
)
from patrl.orchestrator.agent.interaction import interaction_kwargs, load_interactions
from patrl.orchestrator.agent.single_turn_agent_loop import SingleTurnAgentLoop
from patrl.orchestrator.agent.tool_agent_loop import ToolAgentLoop
from patrl.orchestrator.agent.tool_config import ToolConfigError, dotted_class, load_tools
from patrl.orchestrator.agent.tool_pool import ToolPool
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.scoring import Trajectory, TrajectoryOutput
from patrl.rollout import Engine, SamplingParams


class MultiTurnRollout:
    """One replica's multi-turn generation: the tools of `rollout.multi_turn.tool_config_path`
    in a `ToolPool`, a `ToolAgentLoop` with the `rollout.multi_turn.*` limits and
    `data.max_response_length` as the trajectory's budget (model and tool tokens), driven over
    `engine` by an `AgentLoopRunner`. The engine must be idle between calls."""

    def __init__(self, config: JobConfig, engine: Engine) -> None:
        mt = config.rollout.multi_turn
        if mt.tool_config_path is None and mt.interaction_config_path is None:
            raise ValueError(
                "rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path or "
                "rollout.multi_turn.interaction_config_path"
            )
        self.engine = engine
        self.tokenizer: Any = engine.tokenizer
        self.interactions = (
            {}
            if mt.interaction_config_path is None
            else load_interactions(mt.interaction_config_path)
        )
        self.pool = ToolPool(
            [] if mt.tool_config_path is None else load_tools(mt.tool_config_path),
            timeout_s=mt.tool_timeout_s,
            max_response_length=mt.max_tool_response_length,
            truncate_side=mt.tool_response_truncate_side,
        )
        self.response_length = config.data.max_response_length
        context = AgentLoopContext(
            self.tokenizer,
            self.pool,
            tuple(sorted(engine.eos_token_ids)),
            self.response_length,
            mt,
            self.interactions,
        )
        self.context = context
        self.classes = agent_loop_classes(config)  # built on first use (`_loops_for`)
        self.loop = ToolAgentLoop.build(context)
        self.runner = AgentLoopRunner(engine, {DEFAULT_AGENT: self.loop}, DEFAULT_AGENT)
        self.metrics: dict[str, float] = {}  # the last `generate`'s, summed over its samples

    def generate(
        self, items: Sequence[PromptItem], params: Sequence[SamplingParams]
    ) -> list[TrajectoryOutput]:
        """Each of `items` with its `params` (n samples each): one TrajectoryOutput per item,
        its samples in order. Sets `metrics` (tool calls, errors, truncations, turns, and the
        model's and the tools' tokens)."""
        self._loops_for(items)
        rows: list[dict[str, Any]] = []
        row_params: list[SamplingParams] = []
        for item, p in zip(items, params, strict=True):
            row = _row(item)
            for k in range(p.n):
                rows.append(row)
                row_params.append(sample_params_of(p, k))
        outs = self.runner.run(rows, row_params) if rows else []
        self.metrics = rollout_metrics(outs)
        result: list[TrajectoryOutput] = []
        at = 0
        for item, p in zip(items, params, strict=True):
            mine = outs[at : at + p.n]
            at += p.n
            result.append(
                TrajectoryOutput(
                    f"multi_turn-{item.index}",
                    list(mine[0].prompt_ids),
                    [self._trajectory(k, o) for k, o in enumerate(mine)],
                )
            )
        return result

    def generate_partial(
        self,
        groups: Sequence[tuple[str, PromptItem, Sequence[Any], SamplingParams]],
        quota: int,
    ) -> tuple[list[TrajectoryOutput], dict[str, list[AgentLoopOutput | TurnState]]]:
        """A partial rollout of `groups` (request id, item, carried samples, params): a group
        with nothing carried runs its `params.n` samples from the start; a carried one (one
        entry per sample, as this returns them) resumes its TurnStates and keeps its ended
        samples. Stops once `quota` groups ended (`AgentLoopRunner.run_partial`). Returns the
        ended groups as TrajectoryOutputs (request id: the group's) and the others' samples
        by request id; `metrics` are the ended groups'."""
        self._loops_for([item for _, item, _, _ in groups])
        carried: dict[str, list[AgentLoopOutput | TurnState | None]] = {}
        rows: list[dict[str, Any]] = []
        row_params: list[SamplingParams] = []
        where: list[tuple[str, int]] = []  # (group, sample) of each row
        for rid, item, before, p in groups:
            row = _row(item)
            if before:
                carried[rid] = list(before)
                for k, st in enumerate(before):
                    if isinstance(st, TurnState):
                        rows.append({**row, "resume": st})
                        row_params.append(st.sampling_params)
                        where.append((rid, k))
            else:
                carried[rid] = [None] * p.n
                for k in range(p.n):
                    rows.append(row)
                    row_params.append(sample_params_of(p, k))
                    where.append((rid, k))
        outs = self.partial_rows(rows, row_params, [g for g, _ in where], quota)
        for (rid, k), out in zip(where, outs, strict=True):
            carried[rid][k] = out
        done: list[TrajectoryOutput] = []
        rest: dict[str, list[AgentLoopOutput | TurnState]] = {}
        ended: list[AgentLoopOutput] = []
        for rid, _, _, _ in groups:
            samples = carried[rid]
            finished = [o for o in samples if isinstance(o, AgentLoopOutput)]
            if len(finished) == len(samples):
                ended += finished
                done.append(
                    TrajectoryOutput(
                        rid,
                        list(finished[0].prompt_ids),
                        [self._trajectory(k, o) for k, o in enumerate(finished)],
                    )
                )
            else:
                rest[rid] = [o for o in samples if o is not None]
        self.metrics = rollout_metrics(ended)
        return done, rest

    def partial_rows(
        self,
        rows: Sequence[Mapping[str, Any]],
        params: Sequence[SamplingParams],
        keys: Sequence[Any],
        quota: int,
    ) -> list[AgentLoopOutput | TurnState]:
        """The agent-loop samples `rows` (group keys `keys`) run to `quota` groups ended
        (`AgentLoopRunner.run_partial`); none without rows."""
        return self.runner.run_partial(rows, params, keys, quota) if rows else []

    def _loops_for(self, items: Sequence[PromptItem]) -> None:
        """Build the agent loops `items` name that the runner does not hold yet; ValueError
        naming a row's unknown `agent_name` and the registered names."""
        problems = agent_name_problems(items, self.classes)
        if problems:
            raise ValueError("; ".join(problems))
        for item in items:
            name = item.extra.get("agent_name")
            if name is not None and name not in self.runner.agent_loops:
                self.runner.add_loop(name, self.classes[name].build(self.context))

    def _trajectory(self, k: int, out: AgentLoopOutput) -> Trajectory:
        full = len(out.response_ids) >= self.response_length
        return Trajectory(
            k,
            list(out.response_ids),
            list(out.response_logprobs),
            "length" if full else "stop",
            str(self.tokenizer.decode(out.response_ids, skip_special_tokens=True)),
            list(out.response_mask),
            turn_scores(out),
        )


DEFAULT_AGENT = "tool_agent"  # verl's, for a row without `agent_name`
BUILT_IN = {"tool_agent": ToolAgentLoop, "single_turn_agent": SingleTurnAgentLoop}


def agent_loop_classes(config: JobConfig) -> dict[str, type[AgentLoop]]:
    """The agent loops a job's rows may name: every `@register`ed one (the built-in
    `tool_agent` and `single_turn_agent` among them) and those of
    `rollout.agent.agent_loop_config_path` (verl's YAML: a list of `{name, _target_}`, the
    target a dotted path to an AgentLoop subclass). ToolConfigError naming the file and the
    entry's key for one that does not load."""
    classes = {**registered_agent_loops(), **BUILT_IN}  # BUILT_IN: their modules imported
    path = config.rollout.agent.agent_loop_config_path
    if path is None:
        return classes
    file = Path(path)
    if not file.is_file():
        raise ToolConfigError(f"rollout.agent.agent_loop_config_path={path}: no such file")
    try:
        entries = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ToolConfigError(f"agent loop config {path} is not valid YAML: {e}") from e
    if not isinstance(entries, list):
        raise ToolConfigError(
            f"{path}: an agent loop config is a list of {{name, _target_}}, got "
            f"{type(entries).__name__}"
        )
    for i, entry in enumerate(entries):
        where = f"{path}: {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ToolConfigError(f"{where}.name is missing: each entry is {{name, _target_}}")
        cls = dotted_class(
            entry.get("_target_"),
            f"{where}._target_",
            AgentLoop,
            ToolConfigError,
            "patrl.orchestrator.agent.AgentLoop",
        )
        if entry["name"] in BUILT_IN:
            raise ToolConfigError(
                f"{where}.name={entry['name']!r} is a built-in agent loop; give yours another name"
            )
        classes[entry["name"]] = cls
    return classes


def agent_name_problems(items: Iterable[PromptItem], names: Iterable[str]) -> list[str]:
    """One line per distinct unknown `agent_name` of `items` (rows without one run
    `tool_agent`): the value, the first row that has it, and the registered names."""
    known = sorted(names)
    bad: dict[str, int] = {}  # repr of the value (data may hold any value) -> first row
    for item in items:
        name = item.extra.get("agent_name")
        if name is not None and name not in known:
            bad.setdefault(repr(name), item.index)
    return [
        f"row {row}: agent_name={name} is not a registered agent loop; registered: {known} "
        "(add one with rollout.agent.agent_loop_config_path)"
        for name, row in bad.items()
    ]


def _row(item: PromptItem) -> dict[str, Any]:
    """An agent-loop sample's fields for `item`: its messages, its `agent_name` and its
    tools' kwargs where it has them."""
    row: dict[str, Any] = {"raw_prompt": item.messages}
    if item.extra.get("agent_name") is not None:
        row["agent_name"] = item.extra["agent_name"]
    kwargs = tools_kwargs(item)
    if kwargs:
        row["tools_kwargs"] = kwargs
    ikwargs = interaction_kwargs(item.extra)
    if ikwargs is not None:
        row["interaction_kwargs"] = ikwargs
    return row


def turn_scores(out: AgentLoopOutput) -> list[float] | None:
    """A sample's interaction turn scores (verl's `extra_fields["turn_scores"]`), None for a
    sample without an interaction."""
    scores = out.extra_fields.get("turn_scores")
    return None if scores is None else [float(x) for x in scores]


def sample_params_of(p: SamplingParams, k: int) -> SamplingParams:
    """Sample k of a prompt's `p.n`: one sample, seeded from the prompt's seed and k."""
    seed = None if p.seed is None else hash((p.seed, k)) & 0x7FFF_FFFF_FFFF
    return dataclasses.replace(p, n=1, seed=seed)


def made_tokens(sample: AgentLoopOutput | TurnState) -> int:
    """The model tokens a carried sample of a partial rollout has sampled so far."""
    if isinstance(sample, TurnState):
        return sample.model_tokens()
    if isinstance(sample, AgentLoopOutput):
        return sum(sample.response_mask)
    raise TypeError(f"not a carried agent-loop sample: {type(sample).__name__}")


def tools_kwargs(item: PromptItem) -> dict[str, Any] | None:
    """The row's per-tool kwargs, where verl's data keeps them (`extra_info.tools_kwargs`, or
    a `tools_kwargs` column): {tool name: {"create_kwargs": {...}}}."""
    info = item.extra.get("extra_info")
    found = info.get("tools_kwargs") if isinstance(info, dict) else None
    found = found or item.extra.get("tools_kwargs")
    return dict(found) if isinstance(found, dict) else None


def rollout_metrics(outs: Sequence[AgentLoopOutput]) -> dict[str, float]:
    """verl-like multi-turn counters of a rollout: tool calls, their errors and truncations,
    turns, and the model's and the tools' tokens."""
    if not outs:
        return {}
    n = len(outs)
    model = sum(sum(o.response_mask) for o in outs)
    total = sum(len(o.response_ids) for o in outs)
    return {
        "multi_turn/tool_calls": float(sum(o.metrics.get("tool_calls", 0) for o in outs)),
        "multi_turn/tool_errors": float(sum(o.metrics.get("tool_errors", 0) for o in outs)),
        "multi_turn/tool_truncated": float(sum(o.metrics.get("tool_truncated", 0) for o in outs)),
        # the tools' own failures (raised, past the deadline): tool_guard.ToolFailureGuard's
        "multi_turn/tool_exceptions": float(sum(o.metrics.get("tool_exceptions", 0) for o in outs)),
        "multi_turn/tool_timeouts": float(sum(o.metrics.get("tool_timeouts", 0) for o in outs)),
        "multi_turn/num_turns/mean": sum(o.num_turns for o in outs) / n,
        "multi_turn/model_tokens/mean": model / n,
        "multi_turn/tool_tokens/mean": (total - model) / n,
        **interaction_metrics(outs),
    }


def interaction_metrics(outs: Sequence[AgentLoopOutput]) -> dict[str, float]:
    """The interactions' counters of a rollout (none when no sample had an interaction):
    user turns answered, failed calls and their timeouts, the turn scores' mean, and per
    interaction name the answers asked for and the failed ones among them
    (`multi_turn/interaction/<name>/calls`, `.../failures`: `tool_guard.ToolFailureGuard`'s)."""
    with_one = [o for o in outs if "turn_scores" in o.extra_fields]
    if not with_one:
        return {}
    scores = [float(x) for o in with_one for x in o.extra_fields["turn_scores"]]
    result = {
        f"multi_turn/{k}": float(sum(o.metrics.get(k, 0) for o in with_one))
        for k in ("interaction_turns", "interaction_errors", "interaction_timeouts")
    }
    for o in with_one:
        name = o.extra_fields.get("interaction")
        if name is None:
            continue
        for k in ("calls", "failures"):
            key = f"multi_turn/interaction/{name}/{k}"
            result[key] = result.get(key, 0.0) + float(o.metrics.get(f"interaction_{k}", 0))
    if scores:
        result["multi_turn/interaction_turn_score/mean"] = sum(scores) / len(scores)
    return result
