"""The tool demo's long-sums task: its problems and answers are right, its warm start's calls
are well-formed but for its malformed share, which is malformed exactly as intended and answered
as the rollout answers it, the tool answers its calls get are the problems' answers, its build
writes the task's rows, and the example runs two GRPO steps on it."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import random
import re
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from patrl.orchestrator.agent.calculator import CalculatorTool
from patrl.orchestrator.agent.tool_agent_loop import ToolAgentLoop
from patrl.orchestrator.agent.tool_parser import extract_tool_calls
from patrl.orchestrator.agent.tool_pool import ToolPool
from patrl_examples.demo.evaluate import is_correct
from patrl_examples.demo.long_sums import (
    LongSumsConfig,
    SumProblem,
    generate_problems,
    iter_problems,
)
from patrl_examples.demo.reward import calls_tool, well_formed_call
from patrl_examples.demo.sft import IGNORE
from patrl_examples.demo.tokenizer import ASSISTANT, TOOL, build_tool_tokenizer
from patrl_examples.demo.tools import (
    LONG_SUMS_MALFORMED_SFT,
    LONG_SUMS_SFT,
    MALFORMED_KINDS,
    TOOL_TASKS,
    ToolDemoRecipe,
    ToolSFTConfig,
    call_text,
    draw_kind,
    encode_demonstration,
    ensure_tool_demo_assets,
    iter_tool_batches,
    malformed_call_text,
    observation,
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


def trained_turns(ids: list[int], labels: list[int], tokenizer: object) -> list[str]:
    """The text of each run of trained (not IGNORE) ids: the model's turns, in order."""
    turns: list[str] = []
    run: list[int] = []
    for i, lab in zip([*ids, -1], [*labels, IGNORE], strict=True):
        if lab != IGNORE:
            run.append(i)
        elif run:
            turns.append(str(tokenizer.decode(run, skip_special_tokens=False)))  # type: ignore[attr-defined]
            run = []
    return turns


def test_warm_start_demonstrations_call_and_get_right_answers() -> None:
    """Decoded from the very batches the long-sums warm start trains on: a calling
    demonstration trains a call, well-formed or (its malformed share) one the tool loop answers
    with an error or finds no call in; after an error it trains a well-formed call; every
    well-formed call's calculator answer (run here) is the masked tool turn's text and the
    problem's sum, and the box holds it. About 40% call, a fifth of those malformed first (the
    second stage's mix; the first stage's is the same without malformed calls)."""
    tokenizer = build_tool_tokenizer()
    eos = str(tokenizer.eos_token)
    config = LONG_SUMS_MALFORMED_SFT.model_copy(update={"pool_size": 400, "tokens_per_batch": 8192})
    batches = iter_tool_batches(iter_problems(5, LONG_SUMS), tokenizer, config, random.Random(5))
    rows = calling = malformed = 0
    while rows < config.pool_size:
        input_ids, labels = next(batches)
        for ids, labs in zip(input_ids.tolist(), labels.tolist(), strict=True):
            rows += 1
            text = str(tokenizer.decode(ids, skip_special_tokens=False))
            prompt = text.split("<|user|>", 1)[1].split("\n", 1)[0]
            answer = str(sum(addends_of(prompt)))
            turns = trained_turns(ids, labs, tokenizer)
            if calls_tool(turns[0], answer) == 0.0:  # by hand: one turn, no tool turn
                assert len(turns) == 1 and TOOL not in text and "<tool_call>" not in turns[0]
                continue
            calling += 1
            if well_formed_call(turns[0], answer) == 0.0:
                malformed += 1
                bad, *turns = turns
                if not turns:  # the rollout finds no closed call: the sample ends here
                    assert bad.endswith(eos) and "</tool_call>" not in bad and TOOL not in text
                    continue
                # The error observation is the masked tool turn after the malformed call.
                error = observation(bad)
                assert error is not None and error.startswith("Error"), bad
                assert f"{bad}{eos}{TOOL}{error}\n{ASSISTANT}" in text
            assert len(turns) == 2, turns
            call, boxed = turns
            assert well_formed_call(call, answer) == 1.0, call
            _, calls = extract_tool_calls(call, "hermes")
            result = calculate(calls[0].arguments["expression"])  # type: ignore[index]
            assert result == answer, (prompt, call)
            # The masked tool turn holds exactly the calculator's answer.
            assert f"{call}{eos}{TOOL}{result}\n{ASSISTANT}" in text
            assert boxed == f"\\boxed{{{answer}}}{eos}"
    assert rows == config.pool_size
    # Binomial(400, 0.4): sd 0.025, so +-0.08 is three sd.
    assert abs(calling / rows - config.tool_fraction) < 0.08, calling
    # Binomial(~160, 0.2): sd 0.032, so +-0.1 is three sd.
    assert config.malformed_fraction == 0.2
    assert abs(malformed / calling - config.malformed_fraction) < 0.1, malformed


@pytest.fixture(scope="module")
def tool_loop() -> ToolAgentLoop:
    """The rollout's tool loop and tool pool as the demo's config builds them (the calculator,
    tool answers cut at its max_tool_response_length, 64)."""
    tokenizer = build_tool_tokenizer()
    pool = ToolPool([CalculatorTool()], timeout_s=5, max_response_length=64)
    return ToolAgentLoop(tokenizer, pool, [tokenizer.eos_token_id], response_length=384)


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_malformed_calls_are_malformed_as_intended(kind: str, tool_loop: ToolAgentLoop) -> None:
    """Each kind of malformed call has exactly its one defect: mending it gives the well-formed
    call; the demo's format check rejects it, the parser rejects exactly the parse errors (an
    unclosed tag is no call at all, a wrong argument name parses and the calculator refuses
    it); and the demonstration's masked tool turn is the tool pool's answer as the tool loop
    appends it, followed by a well-formed retry (or, for an unclosed tag, nothing)."""
    tokenizer = tool_loop.tokenizer
    for p in generate_problems(50, seed=14, config=LONG_SUMS):
        good, bad = call_text(p), malformed_call_text(p, kind)
        assert calls_tool(bad, str(p.answer)) == 1.0
        assert well_formed_call(bad, str(p.answer)) == 0.0, bad
        assert well_formed_call(good, str(p.answer)) == 1.0
        _, calls = extract_tool_calls(bad, "hermes")
        if kind == "unclosed_tag":
            assert bad + "</tool_call>" == good and calls == []
        elif kind == "wrong_argument":
            assert bad == good.replace('"expression":', '"expr":', 1)
            assert len(calls) == 1 and calls[0].error is None and calls[0].name == "calculator"
            assert calls[0].arguments == {"expr": p.prompt.removeprefix("Add: ")}
        else:
            mended = bad.replace("</tool_call>", "}</tool_call>")
            if kind == "text_in_tag":
                mended = bad.replace("<tool_call>calculator ", "<tool_call>")
            assert mended == good
            assert len(calls) == 1 and calls[0].name is None and calls[0].arguments is None
            assert calls[0].error is not None and "not valid JSON" in calls[0].error
        # What the rollout does with the turn: the tool pool's answer (the reference for
        # `observation`), appended by the tool loop as the demonstration has it.
        demo = encode_demonstration(p, tokenizer, kind)
        prompt = tool_loop.prompt_ids([{"role": "user", "content": p.prompt}])
        bad_ids = tokenizer.encode(bad, add_special_tokens=False)
        if kind == "unclosed_tag":
            assert observation(bad) is None
            trained = [*bad_ids, tokenizer.eos_token_id]  # the turn ends at the model's EOS
            assert demo.ids == prompt + trained
            assert demo.mask == [0] * len(prompt) + [1] * len(trained)
            continue
        outcome = asyncio.run(tool_loop.pool.call(calls[0]))
        assert outcome.text == observation(bad) and outcome.text.startswith("Error")
        assert outcome.error == (None if kind == "wrong_argument" else "malformed")
        assert not outcome.truncated
        error_turn = tool_loop.tool_turn_ids([outcome], ended_with_eos=False)
        good_ids = tokenizer.encode(good, add_special_tokens=False)
        answer_turn = tool_loop.tool_turn_ids(
            [asyncio.run(tool_loop.pool.call(extract_tool_calls(good, "hermes")[1][0]))],
            ended_with_eos=False,
        )
        final = [*tokenizer.encode(p.direct_solution(), add_special_tokens=False)]
        final.append(tokenizer.eos_token_id)
        assert demo.ids == prompt + bad_ids + error_turn + good_ids + answer_turn + final
        assert demo.mask == (
            [0] * len(prompt) + [1] * len(bad_ids) + [0] * len(error_turn)
            + [1] * len(good_ids) + [0] * len(answer_turn) + [1] * len(final)
        )  # fmt: skip
        # The whole demonstration fits the demo's response budget (max_response_length 384).
        assert len(demo.ids) - demo.prompt_len <= 384


def test_no_malformed_share_draws_as_before_and_keeps_its_key() -> None:
    """A recipe without a malformed share draws its demonstrations' kinds as the draw did
    before the share existed (the reference below), and hashes without the field, so earlier
    builds stay valid; a malformed share draws the malformed kinds and changes the key."""

    def reference_kind(rng: random.Random, config: ToolSFTConfig) -> str:
        if rng.random() < config.tool_fraction:
            return "tool"
        return "direct" if rng.random() < config.direct_fraction else "worked"

    clean = LONG_SUMS_SFT.model_copy(update={"malformed_fraction": 0.0})
    a, b = random.Random(3), random.Random(3)
    assert [draw_kind(a, clean) for _ in range(500)] == [
        reference_kind(b, clean) for _ in range(500)
    ]
    rng = random.Random(4)
    kinds = Counter(draw_kind(rng, LONG_SUMS_MALFORMED_SFT) for _ in range(4000))
    assert set(kinds) == {"tool", "worked", *MALFORMED_KINDS}, kinds
    assert LONG_SUMS_SFT.malformed_fraction == 0.0
    recipe = ToolDemoRecipe.default(task="long_sums")
    old = recipe.start
    assert old is not None and old.sft == LONG_SUMS_SFT and old.start is None
    fields = old.model_dump()
    del fields["sft"]["malformed_fraction"], fields["start"]
    payload = json.dumps({"version": 2, **fields}, sort_keys=True)
    assert old.key() == hashlib.sha256(payload.encode()).hexdigest()[:12]
    assert recipe.key() != old.key()
    # The second stage's key names its start: another start, another key.
    other = recipe.model_copy(
        update={"start": old.model_copy(update={"sft": old.sft.model_copy(update={"steps": 7})})}
    )
    assert other.key() != recipe.key()


def test_recipes_by_task_and_unknown_task_refused() -> None:
    assert set(TOOL_TASKS) == {"addition", "long_sums"}
    addition, long_sums = ToolDemoRecipe.default(), ToolDemoRecipe.default(task="long_sums")
    assert addition.task is None and long_sums.task == LONG_SUMS
    assert long_sums.sft == LONG_SUMS_MALFORMED_SFT and addition.start is None
    assert long_sums.start == ToolDemoRecipe(base=long_sums.base, sft=LONG_SUMS_SFT, task=LONG_SUMS)
    with pytest.raises(ValueError, match="same base and task"):
        ToolDemoRecipe(base=addition.base, task=LONG_SUMS, start=addition)
    assert next(addition.problems(3)).prompt.startswith("Add: a")
    assert [next(long_sums.problems(3)) for _ in range(1)] == generate_problems(1, 3, LONG_SUMS)
    assert addition.key() != long_sums.key()
    assert ToolDemoRecipe.default(quick=True, task="long_sums").task == LONG_SUMS
    with pytest.raises(ValueError, match="task='products'"):
        ToolDemoRecipe.default(task="products")


def test_quick_long_sums_build_writes_the_task_rows(tmp_path: Path) -> None:
    recipe = ToolDemoRecipe.default(quick=True, task="long_sums")
    assets = ensure_tool_demo_assets(tmp_path, recipe=recipe, progress=False)
    # Two stages: the second tuned the first's model, each cached under its own key.
    assert recipe.start is not None and recipe.start.start is None
    first = ensure_tool_demo_assets(tmp_path, recipe=recipe.start, progress=False)
    assert first.root != assets.root
    assert assets.manifest["start_model"] == str(first.model_dir)
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
