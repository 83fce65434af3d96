"""Multi-turn rollouts with tools (verl's agent loop and tools), over patrl's engine; the sync
schedule's generate phase with `rollout.multi_turn.enable` (`multi_turn.MultiTurnRollout`,
imported from its module: it needs the job's config). See docs/agent_loop.md."""

from patrl.orchestrator.agent.agent_loop import (
    AgentLoop,
    AgentLoopContext,
    AgentLoopOutput,
    AgentLoopRunner,
    LLMServer,
    TokenOutput,
    register,
    registered_agent_loops,
)
from patrl.orchestrator.agent.base_tool import BaseTool
from patrl.orchestrator.agent.calculator import CalculatorTool
from patrl.orchestrator.agent.schemas import OpenAIFunctionToolSchema, ToolResponse
from patrl.orchestrator.agent.single_turn_agent_loop import SingleTurnAgentLoop
from patrl.orchestrator.agent.tool_agent_loop import ToolAgentLoop
from patrl.orchestrator.agent.tool_config import ToolConfigError, check_tool_config, load_tools
from patrl.orchestrator.agent.tool_parser import FunctionCall, extract_tool_calls
from patrl.orchestrator.agent.tool_pool import ToolOutcome, ToolPool, truncate

__all__ = [
    "AgentLoop",
    "AgentLoopContext",
    "AgentLoopOutput",
    "AgentLoopRunner",
    "BaseTool",
    "CalculatorTool",
    "FunctionCall",
    "LLMServer",
    "OpenAIFunctionToolSchema",
    "SingleTurnAgentLoop",
    "TokenOutput",
    "ToolAgentLoop",
    "ToolConfigError",
    "ToolOutcome",
    "ToolPool",
    "ToolResponse",
    "check_tool_config",
    "extract_tool_calls",
    "load_tools",
    "register",
    "registered_agent_loops",
    "truncate",
]
