"""The built-in example tool: a calculator that evaluates arithmetic by walking its syntax tree
(numbers, + - * / // % **, unary signs, parentheses), never `eval`: any other syntax (names,
calls, attributes) is refused with an error observation, and huge powers are refused."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from patrl.orchestrator.agent.base_tool import BaseTool
from patrl.orchestrator.agent.schemas import OpenAIFunctionToolSchema, ToolResponse

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e100

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}
                },
                "required": ["expression"],
            },
        },
    }
)


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic `expression`; ValueError saying what is not allowed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = _value(tree.body)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{expression!r} is not finite")
    return value


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        if isinstance(node.value, bool):
            raise ValueError(f"only numbers are allowed, got {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as e:
            raise ValueError("division by zero") from e
        if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return result
    raise ValueError(f"only numbers and + - * / // % ** are allowed, got {ast.unparse(node)!r}")


class CalculatorTool(BaseTool):
    """`calculator(expression)`: the expression's value as text, or "Error: ..." saying why
    it could not be evaluated (an answer the model reads, not an exception)."""

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        tool_schema: OpenAIFunctionToolSchema | None = None,
    ) -> None:
        super().__init__(config or {}, tool_schema or SCHEMA)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            return ToolResponse(text="Error: give the expression as a string"), 0.0, {}
        try:
            value = evaluate(expression)
        except ValueError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {}
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return ToolResponse(text=str(value)), 0.0, {}
