"""verl's GSM8K example tool (`verl.tools.gsm8k_tool.Gsm8kTool`) in verl's shape: the model
submits its answer with `calc_gsm8k_reward(answer)` and reads back whether it is right. The
class has verl's methods and signatures, so verl's tool config works with `class_name` changed
to `patrl.orchestrator.agent.gsm8k_tool.Gsm8kTool` (the verl class itself ports by changing its
imports to patrl.orchestrator.agent.base_tool / .schemas and its scorer to `gsm8k_score`).

Each call's instance keeps its ground truth (verl's `create_kwargs`, from the data row's
`extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`) and the best reward
so far; `execute` answers "Current parsed answer='..' reward=.." and a step reward of -0.05
when the answer did not improve on the instance's last one (verl's penalty), 0.0 otherwise.
"""

from __future__ import annotations

import re
from typing import Any
from uuid import uuid4

from patrl.orchestrator.agent.base_tool import BaseTool
from patrl.orchestrator.agent.schemas import OpenAIFunctionToolSchema, ToolResponse

SOLUTION_CLIP_CHARS = 300  # verl scores the end of a long solution only
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_answer(solution: str, method: str = "strict") -> str | None:
    """The final answer in `solution`, as verl's gsm8k scorer reads it: "strict", the last
    `#### <number>` (commas and $ dropped); "flexible", the last number that is not "." alone.
    None when there is none. Only the last SOLUTION_CLIP_CHARS characters are read."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    numbers = [n for n in _FLEXIBLE.findall(tail) if n not in ("", ".")]
    return numbers[-1] if numbers else None


def gsm8k_score(
    solution: str,
    ground_truth: str | None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's `gsm8k.compute_score`: `score` if the answer read by `method` equals
    `ground_truth` (as strings), `format_score` if there is another answer, 0 if none."""
    answer = gsm8k_answer(solution, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


class Gsm8kTool(BaseTool):
    """`calc_gsm8k_reward(answer)`: scores the answer against the instance's ground truth
    (verl's Gsm8kTool: `create` / `execute` / `calc_reward` / `release`, one instance per
    trajectory's call, state in `_instance_dict` as verl keeps it)."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        """An instance for `ground_truth` (given, or verl's `create_kwargs["ground_truth"]`)."""
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instance_dict[instance_id] = {
            "response": "",
            "ground_truth": ground_truth,
            "reward": 0.0,
        }
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instance_dict[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05  # verl's no-improvement penalty
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k_score(
            state["response"], state["ground_truth"], method="flexible", format_score=0.0
        )

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        del self._instance_dict[instance_id]
