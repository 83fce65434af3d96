"""verl's tool config YAML, loaded into tool objects (`verl.tools.utils.tool_registry`)::

    tools:
      - class_name: patrl.orchestrator.agent.calculator.CalculatorTool
        config: {type: native}
        tool_schema:            # OpenAI function schema; optional if the class builds its own
          type: function
          function: {name: calculator, description: ..., parameters: {...}}

Every problem is a `ToolConfigError` naming the file and the key (`tools.0.class_name`): a
file that is missing or not YAML, a `class_name` that does not import or is not a `BaseTool`,
a schema without `function.name`, two tools of one name, a `config.type` other than native.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from patrl.orchestrator.agent.base_tool import BaseTool
from patrl.orchestrator.agent.schemas import OpenAIFunctionToolSchema
from patrl.orchestrator.errors import JobError


class ToolConfigError(JobError):
    """A tool config that cannot be loaded; the message names the file and key."""


def load_tools(path: str | Path) -> list[BaseTool]:
    """The tools of the YAML file at `path`, in its order; ToolConfigError on any problem."""
    entries = _read(Path(path))
    tools: list[BaseTool] = []
    names: dict[str, int] = {}
    for i, entry in enumerate(entries):
        tool = _build(path, i, entry)
        if tool.name in names:
            raise ToolConfigError(
                f"{path}: tools.{i}: a second tool named {tool.name!r} (tools.{names[tool.name]} "
                "has that name); tool names must be unique"
            )
        names[tool.name] = i
        tools.append(tool)
    return tools


def check_tool_config(path: str | Path) -> list[str]:
    """The problems of the tool config at `path` (empty: it loads), for preflight."""
    try:
        load_tools(path)
    except ToolConfigError as e:
        return [str(e)]
    return []


def _read(path: Path) -> Sequence[Any]:
    if not path.is_file():
        raise ToolConfigError(
            f"tool config {path}: no such file (rollout.multi_turn.tool_config_path)"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ToolConfigError(f"tool config {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(
            f"{path}: a tool config is a mapping with a `tools` list "
            "(each item: class_name, config, tool_schema), got "
            f"{type(data).__name__ if not isinstance(data, dict) else 'no tools list'}"
        )
    return data["tools"]


def _build(path: str | Path, i: int, entry: Any) -> BaseTool:
    where = f"{path}: tools.{i}"
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: each tool is a mapping of class_name, config, tool_schema")
    unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
    if unknown:
        raise ToolConfigError(
            f"{where}: unknown keys {unknown}; use class_name, config, tool_schema"
        )
    cls = tool_class(entry.get("class_name"), f"{where}.class_name")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}.config: a mapping, got {config!r:.80}")
    kind = config.get("type", "native")
    if kind != "native":
        raise ToolConfigError(
            f"{where}.config.type={kind!r}: patrl runs native tools only (verl's mcp and "
            "benchmax tools are not supported)"
        )
    schema = _schema(entry.get("tool_schema"), f"{where}.tool_schema")
    try:
        tool = cls(config=config, tool_schema=schema)
    except Exception as e:
        raise ToolConfigError(f"{where}: {cls.__name__}(config, tool_schema) raised {e!r}") from e
    return tool


def tool_class(name: Any, where: str) -> type[BaseTool]:
    """The class a dotted `class_name` names (`package.module.Class`); ToolConfigError
    naming `where` when it does not import or is not a BaseTool."""
    return dotted_class(
        name,
        where,
        BaseTool,
        ToolConfigError,
        "patrl.orchestrator.agent.BaseTool (a verl tool ports by importing BaseTool from there)",
    )


C = TypeVar("C")


def dotted_class(
    name: Any, where: str, base: type[C], error: type[Exception], what: str
) -> type[C]:
    """The subclass of `base` a dotted path names (`package.module.Class`): a tool's, an
    interaction's or an agent loop's class in their config files. `error` naming `where`
    when `name` is not a dotted path, its module does not import, has no such attribute, or
    it is not a subclass of `base` (`what`: the base's public name and how to port to it)."""
    if not isinstance(name, str) or "." not in name:
        raise error(f"{where}={name!r}: give a dotted path, package.module.ClassName")
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise error(f"{where}={name!r}: cannot import {module_name!r}: {e!r}") from e
    cls = getattr(module, attr, None)
    if cls is None:
        raise error(f"{where}={name!r}: module {module_name!r} has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise error(f"{where}={name!r} is not a subclass of {what}")
    return cls


def _schema(raw: Any, where: str) -> OpenAIFunctionToolSchema | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ToolConfigError(f"{where}: an OpenAI function schema mapping, got {raw!r:.80}")
    function = raw.get("function")
    if not isinstance(function, dict) or not function.get("name"):
        raise ToolConfigError(
            f"{where}.function.name is missing: a tool schema is "
            "{type: function, function: {name: ..., description: ..., parameters: {...}}}"
        )
    try:
        return OpenAIFunctionToolSchema.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ToolConfigError(f"{where}.{key}: {first['msg']}") from e
