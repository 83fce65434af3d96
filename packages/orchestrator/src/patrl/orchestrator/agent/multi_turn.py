"""The training loop's multi-turn rollout (`rollout.multi_turn.enable`): a replica's prompts run
through `AgentLoopRunner` + `ToolAgentLoop` on its engine instead of `Engine.generate`, and come
back as `scoring.TrajectoryOutput`s, one per prompt, for `scoring.score_outputs`.

Each prompt's chat messages (`PromptItem.messages`) are the conversation, its row's
`extra_info.tools_kwargs` (verl's) the tools' create kwargs; its `n` samples are
separate agent-loop samples, sample k seeded from the prompt's seed and k (so a group's samples
differ and a rerun samples the same tokens). The trajectory is exactly the engine's tokens and
the appended tool tokens; the reward sees their decoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from patrl.orchestrator.agent.agent_loop import AgentLoopOutput, AgentLoopRunner
from patrl.orchestrator.agent.tool_agent_loop import ToolAgentLoop
from patrl.orchestrator.agent.tool_config import load_tools
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
        if mt.tool_config_path is None:
            raise ValueError(
                "rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path"
            )
        self.engine = engine
        self.tokenizer: Any = engine.tokenizer
        self.pool = ToolPool(
            load_tools(mt.tool_config_path),
            timeout_s=mt.tool_timeout_s,
            max_response_length=mt.max_tool_response_length,
            truncate_side=mt.tool_response_truncate_side,
        )
        self.response_length = config.data.max_response_length
        self.loop = ToolAgentLoop(
            self.tokenizer,
            self.pool,
            sorted(engine.eos_token_ids),
            response_length=self.response_length,
            max_assistant_turns=mt.max_assistant_turns,
            max_user_turns=mt.max_user_turns,
            max_parallel_calls=mt.max_parallel_calls,
            format=mt.format,
        )
        self.runner = AgentLoopRunner(engine, {"tool_agent": self.loop})
        self.metrics: dict[str, float] = {}  # the last `generate`'s, summed over its samples

    def generate(
        self, items: Sequence[PromptItem], params: Sequence[SamplingParams]
    ) -> list[TrajectoryOutput]:
        """Each of `items` with its `params` (n samples each): one TrajectoryOutput per item,
        its samples in order. Sets `metrics` (tool calls, errors, truncations, turns, and the
        model's and the tools' tokens)."""
        rows: list[dict[str, Any]] = []
        row_params: list[SamplingParams] = []
        for item, p in zip(items, params, strict=True):
            row: dict[str, Any] = {"raw_prompt": item.messages}
            tools_kwargs = _tools_kwargs(item)
            if tools_kwargs:
                row["tools_kwargs"] = tools_kwargs
            for k in range(p.n):
                rows.append(row)
                seed = None if p.seed is None else hash((p.seed, k)) & 0x7FFF_FFFF_FFFF
                row_params.append(dataclasses.replace(p, n=1, seed=seed))
        outs = self.runner.run(rows, row_params) if rows else []
        self.metrics = _metrics(outs)
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

    def _trajectory(self, k: int, out: AgentLoopOutput) -> Trajectory:
        full = len(out.response_ids) >= self.response_length
        return Trajectory(
            k,
            list(out.response_ids),
            list(out.response_logprobs),
            "length" if full else "stop",
            str(self.tokenizer.decode(out.response_ids, skip_special_tokens=True)),
            list(out.response_mask),
        )


def _tools_kwargs(item: PromptItem) -> dict[str, Any] | None:
    """The row's per-tool kwargs, where verl's data keeps them (`extra_info.tools_kwargs`, or
    a `tools_kwargs` column): {tool name: {"create_kwargs": {...}}}."""
    info = item.extra.get("extra_info")
    found = info.get("tools_kwargs") if isinstance(info, dict) else None
    found = found or item.extra.get("tools_kwargs")
    return dict(found) if isinstance(found, dict) else None


def _metrics(outs: Sequence[AgentLoopOutput]) -> dict[str, float]:
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
    }
