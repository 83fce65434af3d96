"""verl's `BaseTool`: a tool the agent loop calls, one instance per call, all methods async.

A verl tool class ports by changing its imports: `verl.tools.base_tool` becomes
`patrl.orchestrator.agent.base_tool` and `verl.tools.schemas` becomes
`patrl.orchestrator.agent.schemas`. The agent loop calls, for each parsed call,
`create` -> `execute` -> `release` (release even when execute raises), in a tool worker
(`tool_pool.ToolPool`) under a deadline; `calc_reward` is the tool's own per-instance score,
for a reward function to ask (the loop does not call it). See docs/agent_loop.md.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from patrl.orchestrator.agent.schemas import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    """A tool: `config` (the YAML's `config` mapping) and its OpenAI `tool_schema` (the
    YAML's, or `get_openai_tool_schema()` of a subclass that builds its own); `name` is the
    schema's function name, which a model's call names."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        schema = tool_schema or self.get_openai_tool_schema()
        if schema is None:
            raise ValueError(
                f"{type(self).__name__} has no tool schema: give tool_schema in the tool "
                "config, or override get_openai_tool_schema()"
            )
        self.tool_schema = schema
        self.name = schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        """The tool's schema (a subclass may build it instead of reading it from config)."""
        return getattr(self, "tool_schema", None)

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        """Start an instance for one call (one trajectory's state); returns its id (the given
        one, or a fresh uuid) and an initial response (unused by the loop)."""
        return (instance_id if instance_id is not None else str(uuid4())), ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run the call with the parsed JSON `parameters`; returns (response, step reward,
        metrics). An exception becomes the error observation the model reads."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's reward from the tool's state."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free the instance's state."""
