"""Tool calls parsed out of a model turn's text: verl's `format: hermes`,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/Qwen3, Hermes).

A call whose JSON does not parse, or lacks `name` or an object of `arguments`, is kept as a
call with an `error`: the agent loop answers it with verl's error observation, so the model
reads what went wrong (verl drops such a call, and ends the sample when none is left).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FORMATS = ("hermes",)

_HERMES = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """One call: the function `name` and its `arguments` (parsed JSON object); or, for a call
    that could not be parsed, `error` saying why (name and arguments then may be None)."""

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None


def extract_tool_calls(text: str, format: str = "hermes") -> tuple[str, list[FunctionCall]]:
    """(`text` without its tool calls, the calls in order) for the `format` (hermes only)."""
    if format not in FORMATS:
        raise ValueError(f"tool call format {format!r} is not supported; use one of {FORMATS}")
    calls = [_parse(m) for m in _HERMES.findall(text)]
    return _HERMES.sub("", text), calls


def _parse(body: str) -> FunctionCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return FunctionCall(None, None, f"the tool call is not valid JSON ({e})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return FunctionCall(None, None, 'the tool call has no "name"')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return FunctionCall(call["name"], None, f"the arguments are not valid JSON ({e})")
    if not isinstance(arguments, dict):
        return FunctionCall(call["name"], None, '"arguments" is not a JSON object')
    return FunctionCall(call["name"], arguments)
