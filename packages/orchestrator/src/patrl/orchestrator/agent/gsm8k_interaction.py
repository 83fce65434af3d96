"""verl's GSM8K interaction (`verl.interactions.gsm8k_interaction.Gsm8kInteraction`) in verl's
shape: after each final assistant turn the simulated user scores the turn's answer against the
row's ground truth (`extra_info.interaction_kwargs.ground_truth`, verl's) with verl's flexible
GSM8K scorer; a right answer ends the conversation ("Your response is correct!"), a wrong one
asks for another attempt ("Your response is incorrect! You need to reflect on your answer and
try again."). The turn's score is the answer's (1.0 or 0.0). verl's interaction config works
with `class_name` changed to `patrl.orchestrator.agent.gsm8k_interaction.Gsm8kInteraction`.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from patrl.orchestrator.agent.gsm8k_tool import gsm8k_score
from patrl.orchestrator.agent.interaction import BaseInteraction

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    """One instance per sample in `_instance_dict` (as verl keeps it): the ground truth, the
    last answer read (prefixed "#### " as verl does) and its reward."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any
    ) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {
            "response": "",
            "ground_truth": ground_truth,
            "reward": 0.0,
        }
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        content = ""
        for item in reversed(messages):  # the last assistant turn's text
            if item.get("role") == "assistant":
                content = item.get("content") or ""
                break
        state = self._instance_dict[instance_id]
        state["response"] = content if content.startswith("#### ") else "#### " + content
        reward = await self.calculate_score(instance_id)
        state["reward"] = reward
        if reward == 1.0:
            return True, CORRECT, reward, {}
        return False, INCORRECT, reward, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k_score(
            state["response"], state["ground_truth"], method="flexible", format_score=0.0
        )

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._instance_dict.pop(instance_id, None)
