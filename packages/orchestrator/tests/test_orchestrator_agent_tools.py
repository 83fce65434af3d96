"""Tools as verl defines them: the calculator (arithmetic by its syntax tree, nothing else),
hermes parsing, the tool pool's faults and truncation, the tool config YAML's errors (naming
file and key), and `rollout.multi_turn`'s keys, verl's spelling and preflight's checks."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from patrl.orchestrator.agent import (
    BaseTool,
    CalculatorTool,
    FunctionCall,
    ToolConfigError,
    ToolPool,
    ToolResponse,
    extract_tool_calls,
    load_tools,
    truncate,
)
from patrl.orchestrator.agent.calculator import SCHEMA, evaluate
from patrl.orchestrator.config import ConfigError, load_config
from patrl.orchestrator.preflight import multi_turn_problems

CALCULATOR = "patrl.orchestrator.agent.calculator.CalculatorTool"


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("6*7", 42),
        ("(3 + 4) * 12", 84),
        ("-2 ** 3", -8),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("2**10 % 7", 2),
    ],
)
def test_the_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "only numbers"),
        ("x + 1", "only numbers"),
        ("(1).__class__", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("9 ** 999999", "exponent"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than"),
    ],
)
def test_the_calculator_refuses_anything_but_arithmetic(expression: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        evaluate(expression)
    response, _, _ = asyncio.run(CalculatorTool().execute("i", {"expression": expression}))
    assert response.text is not None and response.text.startswith("Error: ")


# ------------------------------------------------------------------- parsing


def test_hermes_calls_are_parsed_in_order_and_bad_ones_kept_with_their_error() -> None:
    text = (
        'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}'
        '</tool_call>\n<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2\\"}"}'
        "</tool_call><tool_call>{oops</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>'
    )
    content, calls = extract_tool_calls(text)
    assert content == "Let me compute.\n"
    assert calls[0] == FunctionCall("calculator", {"expression": "1+1"})
    assert calls[1] == FunctionCall("calculator", {"expression": "2"})
    assert calls[2].error is not None and "not valid JSON" in calls[2].error
    assert calls[3].error == 'the tool call has no "name"'
    assert calls[4].error == '"arguments" is not a JSON object'
    assert extract_tool_calls("no calls <tool_call> unclosed") == (
        "no calls <tool_call> unclosed",
        [],
    )
    with pytest.raises(ValueError, match="'gpt-oss' is not supported; use one of"):
        extract_tool_calls("", "gpt-oss")


# ---------------------------------------------------------------------- pool


def test_truncation_keeps_verls_sides() -> None:
    assert truncate("abcdef", 6, "left") == "abcdef"
    assert truncate("abcdefgh", 4, "left") == "abcd...(truncated)"
    assert truncate("abcdefgh", 4, "right") == "(truncated)...efgh"
    assert truncate("abcdefgh", 4, "middle") == "ab...(truncated)...gh"


class Recording(BaseTool):
    """Counts its instances' lifecycle; blocks while `hold` is clear; raises on "boom"."""

    hold = threading.Event()
    running = 0
    most = 0
    released = 0
    lock = threading.Lock()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        with Recording.lock:
            Recording.running += 1
            Recording.most = max(Recording.most, Recording.running)
        try:
            if parameters.get("boom"):
                raise KeyError("boom")
            Recording.hold.wait(30)
            return ToolResponse(text="ok"), 1.0, {"n": 1}
        finally:
            with Recording.lock:
                Recording.running -= 1

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        with Recording.lock:
            Recording.released += 1


def test_the_pool_answers_every_fault_and_bounds_its_workers() -> None:
    Recording.hold.clear()
    Recording.most = Recording.released = 0
    tool = Recording({}, SCHEMA)
    pool = ToolPool([tool], timeout_s=30, max_workers=2)

    async def main() -> list[Any]:
        calls = [pool.call(FunctionCall("calculator", {})) for _ in range(4)]
        tasks = [asyncio.ensure_future(c) for c in calls]
        while Recording.running < 2:  # two start; the other two wait for a worker
            await asyncio.sleep(0.01)
        Recording.hold.set()
        return list(await asyncio.gather(*tasks))

    outcomes = asyncio.run(main())
    assert [o.text for o in outcomes] == ["ok"] * 4 and Recording.most == 2
    assert outcomes[0].reward == 1.0 and outcomes[0].metrics == {"n": 1}
    raised = asyncio.run(pool.call(FunctionCall("calculator", {"boom": True})))
    assert (raised.text, raised.error) == ("Error when executing tool: 'boom'", "exception")
    assert Recording.released == 5  # release ran after each execute, raising or not
    unknown = asyncio.run(pool.call(FunctionCall("search", {})))
    assert (
        unknown.text
        == "Error when executing tool: unknown tool 'search'; the tools are ['calculator']"
    )
    malformed = asyncio.run(pool.call(FunctionCall(None, None, 'the tool call has no "name"')))
    assert malformed.error == "malformed"
    with pytest.raises(ValueError, match="truncate_side must be left, middle or right"):
        ToolPool([tool], truncate_side="top")  # type: ignore[arg-type]


# --------------------------------------------------------------- tool config


def write(path: Path, data: Any) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def entry(**overrides: Any) -> dict[str, Any]:
    return {
        "class_name": CALCULATOR,
        "config": {"type": "native"},
        "tool_schema": SCHEMA.model_dump(),
        **overrides,
    }


def test_verls_tool_config_loads_with_and_without_a_schema(tmp_path: Path) -> None:
    (tool,) = load_tools(write(tmp_path / "t.yaml", {"tools": [entry()]}))
    assert isinstance(tool, CalculatorTool) and tool.name == "calculator"
    (tool,) = load_tools(write(tmp_path / "t.yaml", {"tools": [{"class_name": CALCULATOR}]}))
    assert tool.tool_schema == SCHEMA  # the class builds its own


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("tools: [", "is not valid YAML"),
        ({"tool": []}, "a mapping with a `tools` list"),
        (
            {"tools": [entry(class_name="nowhere.Tool")]},
            "tools.0.class_name='nowhere.Tool': cannot import 'nowhere'",
        ),
        (
            {"tools": [entry(class_name="patrl.orchestrator.agent.calculator.Nope")]},
            "tools.0.class_name=.*has no 'Nope'",
        ),
        (
            {"tools": [entry(class_name="pathlib.Path")]},
            "tools.0.class_name='pathlib.Path' is not a subclass",
        ),
        ({"tools": [entry(class_name="Calculator")]}, "give a dotted path"),
        (
            {"tools": [entry(tool_schema={"type": "function", "function": {"description": "x"}})]},
            "tools.0.tool_schema.function.name is missing",
        ),
        ({"tools": [entry(), entry()]}, "tools.1: a second tool named 'calculator'"),
        (
            {"tools": [entry(config={"type": "mcp"})]},
            "tools.0.config.type='mcp': patrl runs native tools only",
        ),
        ({"tools": [entry(extra=1)]}, r"tools.0: unknown keys \['extra'\]"),
    ],
)
def test_a_tool_config_that_does_not_load_is_named_with_its_key(
    tmp_path: Path, content: Any, message: str
) -> None:
    path = tmp_path / "tools.yaml"
    if content is not None:
        write(path, content)
    with pytest.raises(ToolConfigError, match=message) as info:
        load_tools(path)
    assert str(path) in str(info.value)


# ---------------------------------------------------------------------- keys


def test_verls_multi_turn_keys_are_patrls_and_validated(tmp_path: Path) -> None:
    keys = {
        "enable": "true",
        "max_assistant_turns": 3,
        "max_user_turns": 2,
        "tool_config_path": tmp_path / "t.yaml",
        "max_parallel_calls": 2,
        "max_tool_response_length": 100,
        "tool_response_truncate_side": "left",
        "format": "hermes",
    }
    overrides = [f"actor_rollout_ref.rollout.multi_turn.{k}={v}" for k, v in keys.items()]
    mt = load_config(None, ["data.train_files=/d.jsonl", *overrides]).rollout.multi_turn
    assert (mt.enable, mt.max_assistant_turns, mt.max_user_turns) == (True, 3, 2)
    assert (mt.max_parallel_calls, mt.max_tool_response_length) == (2, 100)
    assert (mt.tool_response_truncate_side, mt.format) == ("left", "hermes")
    assert mt.tool_config_path == str(tmp_path / "t.yaml")
    for bad in ("tool_response_truncate_side=top", "format=gpt-oss", "max_parallel_calls=0"):
        with pytest.raises(ConfigError, match=r"rollout\.multi_turn"):
            load_config(None, ["data.train_files=/d.jsonl", f"rollout.multi_turn.{bad}"])


def test_preflight_checks_the_tool_config_and_what_enable_needs(tmp_path: Path) -> None:
    good = write(tmp_path / "good.yaml", {"tools": [entry()]})
    bad = write(tmp_path / "bad.yaml", {"tools": [entry(class_name="nowhere.Tool")]})
    config = load_config(
        None, ["data.train_files=/d.jsonl", f"rollout.multi_turn.tool_config_path={good}"]
    )
    assert multi_turn_problems(config) == []
    config = load_config(
        None, ["data.train_files=/d.jsonl", f"rollout.multi_turn.tool_config_path={bad}"]
    )
    (problem,) = multi_turn_problems(config)
    assert (
        problem.startswith("rollout.multi_turn.tool_config_path: ")
        and "tools.0.class_name" in problem
    )
    config = load_config(None, ["data.train_files=/d.jsonl", "rollout.multi_turn.enable=true"])
    (unset,) = multi_turn_problems(config)  # the defaults: no tools (adaptive TP composes)
    assert "rollout.multi_turn.tool_config_path is unset" in unset


def test_a_multi_turn_job_preflight_names_a_bad_tool_config_and_accepts_partial_rollouts(
    assets: Path, tmp_path: Path
) -> None:
    from patrl.orchestrator import preflight
    from patrl_testkit.jobs import tiny_job_overrides

    bad = write(tmp_path / "bad.yaml", {"tools": [entry(tool_schema={"function": {}})]})
    extra = {
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.tool_config_path": bad,
        "rollout.over_sample_rate": "0.5",
    }
    config = preflight.load(None, tiny_job_overrides(assets, tmp_path / "run", **extra))
    with pytest.raises(preflight.PreflightError) as info:
        preflight.check(config, 1)
    (schema,) = info.value.problems  # over_sample_rate > 0 (partial rollouts) is not refused
    assert "tools.0.tool_schema.function.name is missing" in schema and str(bad) in schema
    good = write(tmp_path / "good.yaml", {"tools": [entry()]})
    extra = {
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.tool_config_path": good,
        "rollout.over_sample_rate": "0.5",
    }
    config = preflight.load(None, tiny_job_overrides(assets, tmp_path / "run", **extra))
    preflight.check(config, 1)  # the control: static TP, sync, partial, a good tool config


class Remembering(BaseTool):
    """Answers with what `create` got (verl's tools_kwargs[name]["create_kwargs"])."""

    seen: ClassVar[dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any:
        instance_id, response = await super().create(instance_id, **kwargs)
        Remembering.seen[instance_id] = kwargs["create_kwargs"]
        return instance_id, response

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        return ToolResponse(text=repr(Remembering.seen.pop(instance_id))), 0.0, {}


def test_a_call_creates_its_instance_with_verls_create_kwargs() -> None:
    pool = ToolPool([Remembering({}, SCHEMA)])
    outcome = asyncio.run(pool.call(FunctionCall("calculator", {}), {"ground_truth": "42"}))
    assert outcome.text == "{'ground_truth': '42'}" and Remembering.seen == {}
