"""Stops a multi-turn run whose tools all fail: a tool that raises or passes its deadline on
every call answers every sample with an error observation, so the model learns from nothing a
tool said, yet the run would go on. The guard reads a step's `multi_turn/*` counters (summed
over replicas, so every rank decides alike) and stops the run after `reward.max_failed_steps`
such steps in a row, as `rewards.FailureGuard` does for rewards.

Only the tools' own failures count (`tool_exceptions`, `tool_timeouts`): a malformed call or
an unknown tool name is the model's mistake, answered with an observation and not held against
the tools, and such calls are left out of the calls that reached a tool. A step with no call
that reached a tool says nothing about the tools and leaves the count as it was.

verl's interactions are watched alike, each by its name: a step on which every answer asked of
an interaction failed (`multi_turn/interaction/<name>/calls` and `.../failures`: each
generate_response call, and each start_interaction that failed, raised, timed out or gave no
4-tuple) counts toward its own streak, and `reward.max_failed_steps` such steps in a row stop
the run with `InteractionsFailed` naming the interaction and the count.
"""

from __future__ import annotations

from collections.abc import Mapping

from patrl.orchestrator.errors import JobError

_INTERACTION = "multi_turn/interaction/"


class ToolsFailed(JobError):
    """Every tool call that reached a tool failed for `max_failed_steps` steps in a row, or on
    every step of a run shorter than that."""


class InteractionsFailed(JobError):
    """Every answer asked of one interaction failed for `max_failed_steps` steps in a row, or
    on every step of a run shorter than that."""


class ToolFailureGuard:
    """`observe(step, metrics)` after each training step's rollout: returns an error line for
    a step on which every call that reached a tool failed (raised or timed out), None
    otherwise; raises `ToolsFailed` on the `max_failed_steps`-th such step in a row, or on the
    run's last step (`last`) when every step it observed with tool calls failed so. Each
    interaction's answers alike (`InteractionsFailed`); the lines of a step join with "; "."""

    def __init__(self, max_failed_steps: int) -> None:
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        self.max_failed_steps = max_failed_steps
        self.streak = 0
        self.steps = 0  # steps observed that had calls reaching a tool
        # per interaction name: failed steps in a row, steps observed that asked it
        self.interaction_streak: dict[str, int] = {}
        self.interaction_steps: dict[str, int] = {}

    def observe(self, step: int, metrics: Mapping[str, float], last: bool = False) -> str | None:
        lines = [self._tools(step, metrics, last)]
        names = sorted(
            k[len(_INTERACTION) : -len("/calls")]
            for k in metrics
            if k.startswith(_INTERACTION) and k.endswith("/calls")
        )
        lines += [self._interaction(step, name, metrics, last) for name in names]
        found = [line for line in lines if line is not None]
        return "; ".join(found) if found else None

    def _interaction(
        self, step: int, name: str, metrics: Mapping[str, float], last: bool
    ) -> str | None:
        calls = int(metrics.get(f"{_INTERACTION}{name}/calls", 0))
        failures = int(metrics.get(f"{_INTERACTION}{name}/failures", 0))
        if calls <= 0:
            return None
        steps = self.interaction_steps[name] = self.interaction_steps.get(name, 0) + 1
        if failures < calls:
            self.interaction_streak[name] = 0
            return None
        streak = self.interaction_streak[name] = self.interaction_streak.get(name, 0) + 1
        line = (
            f"step {step}: every one of the {calls} answers asked of interaction {name!r} failed "
            "(raised, timed out or not a 4-tuple; multi_turn/interaction_errors counts them): "
            "each such sample ended without the user's turn"
        )
        fix = (
            f"Fix interaction {name!r} of rollout.multi_turn.interaction_config_path (call its "
            "start_interaction and generate_response by hand), or raise "
            "rollout.multi_turn.tool_timeout_s if its calls time out"
        )
        if streak >= self.max_failed_steps:
            raise InteractionsFailed(
                f"{line}. That is {streak} steps in a row (reward.max_failed_steps="
                f"{self.max_failed_steps}): the run stops. {fix}"
            )
        if last and streak == steps:
            raise InteractionsFailed(
                f"{line}. That is every step of this run that asked it ({steps}; it ends here, "
                "at trainer.total_training_steps, before reward.max_failed_steps="
                f"{self.max_failed_steps} is reached): it never answered. {fix}"
            )
        return f"{line} ({streak} of reward.max_failed_steps={self.max_failed_steps})"

    def _tools(self, step: int, metrics: Mapping[str, float], last: bool) -> str | None:
        calls = int(metrics.get("multi_turn/tool_calls", 0))
        errors = int(metrics.get("multi_turn/tool_errors", 0))
        raised = int(metrics.get("multi_turn/tool_exceptions", 0))
        timed_out = int(metrics.get("multi_turn/tool_timeouts", 0))
        reached = calls - (errors - raised - timed_out)  # less malformed / unknown-tool calls
        if reached <= 0:
            return None
        self.steps += 1
        if raised + timed_out < reached:
            self.streak = 0
            return None
        self.streak += 1
        line = (
            f"step {step}: every one of the {reached} tool calls failed ({raised} raised, "
            f"{timed_out} timed out); each sample read an error observation instead of an answer"
        )
        fix = (
            "Fix the tools of rollout.multi_turn.tool_config_path (call one by hand), or raise "
            "rollout.multi_turn.tool_timeout_s if their calls time out"
        )
        if self.streak >= self.max_failed_steps:
            raise ToolsFailed(
                f"{line}. That is {self.streak} steps in a row (reward.max_failed_steps="
                f"{self.max_failed_steps}): the run stops. {fix}"
            )
        if last and self.streak == self.steps:
            raise ToolsFailed(
                f"{line}. That is every step of this run with tool calls ({self.steps}; it ends "
                "here, at trainer.total_training_steps, before reward.max_failed_steps="
                f"{self.max_failed_steps} is reached): no tool ever answered. {fix}"
            )
        return f"{line} ({self.streak} of reward.max_failed_steps={self.max_failed_steps})"
