"""The tool demo's long-sums task: its problems and answers are right, its warm start's calls
are well-formed and the tool answers they get are the problems' answers, its build writes the
task's rows, and the example runs two GRPO steps on it."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import re
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from patrl.orchestrator.agent.calculator import CalculatorTool
from patrl.orchestrator.agent.tool_parser import extract_tool_calls
from patrl_examples.demo.evaluate import is_correct
from patrl_examples.demo.long_sums import (
    LongSumsConfig,
    SumProblem,
    generate_problems,
    iter_problems,
)
from patrl_examples.demo.reward import well_formed_call
from patrl_examples.demo.sft import IGNORE
from patrl_examples.demo.tokenizer import ASSISTANT, TOOL, build_tool_tokenizer
from patrl_examples.demo.tools import (
    LONG_SUMS_SFT,
    TOOL_TASKS,
    ToolDemoRecipe,
    call_text,
    ensure_tool_demo_assets,
    iter_tool_batches,
)

ROOT = Path(__file__).resolve().parents[2]
LONG_SUMS = LongSumsConfig()
_PROMPT = re.compile(r"Add: (\d+(?:\+\d+)+)")


def addends_of(prompt: str) -> tuple[int, ...]:
    """The numbers of an `Add: 325+267+630` prompt, read back from its text."""
    match = _PROMPT.fullmatch(prompt)
    assert match is not None, prompt
    return tuple(int(x) for x in match.group(1).split("+"))


def calculate(expression: str) -> str:
    response, _, _ = asyncio.run(CalculatorTool().execute("t", {"expression": expression}))
    return str(response.text)


def test_long_sums_are_two_to_four_numbers_of_two_or_three_digits() -> None:
    problems = generate_problems(3000, seed=11, config=LONG_SUMS)
    assert problems == generate_problems(3000, seed=11, config=LONG_SUMS)
    counts = Counter(len(p.addends) for p in problems)
    assert set(counts) == {2, 3, 4} and min(counts.values()) >= 900, counts  # uniform: ~1000
    numbers = [x for p in problems for x in p.addends]
    assert min(numbers) == 10 and max(numbers) == 999
    assert sum(x >= 100 for x in numbers) / len(numbers) > 0.8  # mostly three digits


def test_long_sums_answers_are_the_sums_the_prompts_state() -> None:
    for p in generate_problems(500, seed=12, config=LONG_SUMS):
        numbers = addends_of(p.prompt)
        assert numbers == p.addends
        # The reference: Python's sum of the numbers read back from the prompt's text.
        assert p.answer == sum(numbers)
        assert p.record() == {
            "prompt": p.prompt,
            "answer": str(sum(numbers)),
            "num_steps": len(numbers) - 1,
        }
        assert is_correct(p.direct_solution(), str(sum(numbers)))
        # By hand: one line per running sum, each right, the box holding the total.
        lines = p.solution().splitlines()
        assert len(lines) == len(numbers)
        total = numbers[0]
        for line, x in zip(lines[:-1], numbers[1:], strict=True):
            assert line == f"{total}+{x}={total + x}", line
            total += x
        assert lines[-1] == f"\\boxed{{{sum(numbers)}}}"


def test_bad_long_sums_are_refused() -> None:
    with pytest.raises(ValueError, match="two or more"):
        SumProblem((5,))
    with pytest.raises(ValueError, match="empty range"):
        LongSumsConfig(min_numbers=4, max_numbers=3)


def test_the_calculator_answers_a_long_sums_call_with_the_sum() -> None:
    for p in generate_problems(200, seed=13, config=LONG_SUMS):
        text = call_text(p)
        # The call's expression is the prompt's, character for character.
        assert f'"expression": "{p.prompt.removeprefix("Add: ")}"' in text
        assert well_formed_call(text, str(p.answer)) == 1.0
        _, calls = extract_tool_calls(text, "hermes")
        assert len(calls) == 1 and calls[0].name == "calculator"
        assert calculate(calls[0].arguments["expression"]) == str(p.answer)  # type: ignore[index]


def test_warm_start_demonstrations_call_well_and_get_right_answers() -> None:
    """Decoded from the very batches the long-sums warm start trains on: a demonstration with a
    tool turn trains a well-formed call whose calculator answer (run here) is the masked tool
    turn's text and the problem's sum, then trains boxing it; about 30% call."""
    tokenizer = build_tool_tokenizer()
    config = LONG_SUMS_SFT.model_copy(update={"pool_size": 200, "tokens_per_batch": 4096})
    batches = iter_tool_batches(iter_problems(5, LONG_SUMS), tokenizer, config, random.Random(5))
    rows = 0
    tool_rows = 0
    while rows < config.pool_size:
        input_ids, labels = next(batches)
        for ids, labs in zip(input_ids.tolist(), labels.tolist(), strict=True):
            rows += 1
            text = str(tokenizer.decode(ids, skip_special_tokens=False))
            prompt = text.split("<|user|>", 1)[1].split("\n", 1)[0]
            answer = str(sum(addends_of(prompt)))
            trained = "".join(
                str(tokenizer.decode([i], skip_special_tokens=False))
                for i, lab in zip(ids, labs, strict=True)
                if lab != IGNORE
            )
            if TOOL not in text:
                assert "<tool_call>" not in trained
                continue
            tool_rows += 1
            call, boxed = trained.split("</tool_call>")
            call += "</tool_call>"
            assert well_formed_call(call, answer) == 1.0, call
            _, calls = extract_tool_calls(call, "hermes")
            result = calculate(calls[0].arguments["expression"])  # type: ignore[index]
            assert result == answer, (prompt, call)
            # The masked tool turn holds exactly the calculator's answer.
            assert f"{TOOL}{result}\n{ASSISTANT}" in text
            assert boxed == f"\\boxed{{{answer}}}{tokenizer.eos_token}"
    assert rows == config.pool_size
    # Binomial(200, 0.3): sd 0.032, so +-0.1 is three sd.
    assert abs(tool_rows / rows - LONG_SUMS_SFT.tool_fraction) < 0.1, tool_rows


def test_recipes_by_task_and_unknown_task_refused() -> None:
    assert set(TOOL_TASKS) == {"addition", "long_sums"}
    addition, long_sums = ToolDemoRecipe.default(), ToolDemoRecipe.default(task="long_sums")
    assert addition.task is None and long_sums.task == LONG_SUMS
    assert long_sums.sft == LONG_SUMS_SFT
    assert next(addition.problems(3)).prompt.startswith("Add: a")
    assert [next(long_sums.problems(3)) for _ in range(1)] == generate_problems(1, 3, LONG_SUMS)
    assert addition.key() != long_sums.key()
    assert ToolDemoRecipe.default(quick=True, task="long_sums").task == LONG_SUMS
    with pytest.raises(ValueError, match="task='products'"):
        ToolDemoRecipe.default(task="products")


def test_quick_long_sums_build_writes_the_task_rows(tmp_path: Path) -> None:
    recipe = ToolDemoRecipe.default(quick=True, task="long_sums")
    assets = ensure_tool_demo_assets(tmp_path, recipe=recipe, progress=False)
    splits = {}
    for path, split, count in (
        (assets.train_file, "train", recipe.base.num_train),
        (assets.val_file, "test", recipe.base.num_val),
    ):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == count
        for row in rows:
            numbers = addends_of(row["prompt"])
            assert 2 <= len(numbers) <= 4 and all(10 <= x <= 999 for x in numbers)
            assert row["answer"] == str(sum(numbers))
            assert row["extra_info"] == {"split": split}
        splits[split] = {r["prompt"] for r in rows}
    assert not splits["train"] & splits["test"]


def load_example() -> ModuleType:
    path = ROOT / "examples" / "grpo_tools.py"
    spec = importlib.util.spec_from_file_location("grpo_tools", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e  # runs examples/grpo_tools.py's job in this process
def test_example_runs_two_grpo_steps_on_long_sums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATRL_CACHE_DIR", str(tmp_path / "cache"))
    overrides = {
        "data.train_batch_size": 4,
        "data.max_response_length": 64,
        "data.val_batch_size": 8,
        "actor.ppo_mini_batch_size": 4,
        "rollout.n": 2,
        "reward.num_workers": 0,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.resume_mode": "disable",
        "trainer.default_local_dir": tmp_path / "run",
    }
    argv = ["--task", "long_sums", "--quick", *(f"{k}={v}" for k, v in overrides.items())]
    assert load_example().run(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/patrl_examples.demo.reward:calls_tool/mean" in r]
    assert [int(r["step"]) for r in steps] == [1, 2]
    assert all("multi_turn/tool_calls" in r for r in steps)
    data = [
        json.loads(line)
        for line in next((tmp_path / "cache").glob("demo-tools-*/data/train.jsonl"))
        .read_text()
        .splitlines()
    ]
    assert all(10 <= x <= 999 for r in data for x in addends_of(r["prompt"]))
