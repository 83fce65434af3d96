"""The tool demo's warm start: its demonstrations are exactly what the agent loop renders and
appends at rollout time, trained on the model's own tokens only; its tokenizer leaves the plain
demo's alone; its logged-only rewards; a quick build from a quick plain demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from patrl.orchestrator.agent.calculator import CalculatorTool
from patrl.orchestrator.agent.tool_agent_loop import ToolAgentLoop
from patrl.orchestrator.agent.tool_config import load_tools
from patrl.orchestrator.agent.tool_pool import ToolOutcome, ToolPool
from patrl_examples.demo.reward import calls_tool, malformed_call_penalty, well_formed_call
from patrl_examples.demo.sft import IGNORE
from patrl_examples.demo.task import Problem
from patrl_examples.demo.tokenizer import TOOL, build_tokenizer, build_tool_tokenizer
from patrl_examples.demo.tools import (
    ToolDemoRecipe,
    call_text,
    collate_masked,
    copy_rows_with_split,
    encode_demonstration,
    ensure_tool_demo_assets,
)

PROBLEM = Problem((7, 1, 5))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tool_tokenizer()


@pytest.fixture(scope="module")
def loop(tokenizer):
    pool = ToolPool([CalculatorTool()], timeout_s=5)
    return ToolAgentLoop(tokenizer, pool, [tokenizer.eos_token_id], response_length=256)


def test_tool_demonstration_is_what_the_agent_loop_renders_and_appends(tokenizer, loop):
    demo = encode_demonstration(PROBLEM, tokenizer, "tool")
    prompt = loop.prompt_ids([{"role": "user", "content": PROBLEM.prompt}])
    call = tokenizer.encode(call_text(PROBLEM), add_special_tokens=False)
    # The tool turn as the loop appends it after a turn stopped at </tool_call> (no EOS sampled).
    appended = loop.tool_turn_ids([ToolOutcome(text="13")], ended_with_eos=False)
    final = [*tokenizer.encode("\\boxed{13}", add_special_tokens=False), tokenizer.eos_token_id]
    assert demo.ids == prompt + call + appended + final
    assert demo.prompt_len == len(prompt)
    assert demo.mask == [0] * len(prompt) + [1] * len(call) + [0] * len(appended) + [1] * len(final)
    # The masked tool turn holds the tool's answer under the tool role marker, and the EOS
    # that closes the call's turn (the template's, not the model's).
    text = tokenizer.decode(appended, skip_special_tokens=False)
    assert text == f"{tokenizer.eos_token}{TOOL}13\n<|assistant|>"
    assert tokenizer.decode(prompt, skip_special_tokens=False).startswith("<s>tools: calculator\n")


@pytest.mark.parametrize(
    ("kind", "answer"), [("direct", PROBLEM.direct_solution()), ("worked", PROBLEM.solution())]
)
def test_plain_demonstrations_train_the_answer_and_its_eos(tokenizer, loop, kind, answer):
    demo = encode_demonstration(PROBLEM, tokenizer, kind)
    prompt = loop.prompt_ids([{"role": "user", "content": PROBLEM.prompt}])
    trained = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
    assert demo.ids == prompt + trained
    assert demo.mask == [0] * len(prompt) + [1] * len(trained)


def test_unknown_kind_is_refused(tokenizer):
    with pytest.raises(ValueError, match="kind='chat'"):
        encode_demonstration(PROBLEM, tokenizer, "chat")


def test_collate_masks_tool_turns_and_padding(tokenizer):
    a = encode_demonstration(PROBLEM, tokenizer, "tool")
    b = encode_demonstration(PROBLEM, tokenizer, "direct")
    input_ids, labels = collate_masked([a, b], tokenizer.pad_token_id)
    for row, d in enumerate((a, b)):
        assert input_ids[row, : len(d.ids)].tolist() == d.ids
        want = [i if m else IGNORE for i, m in zip(d.ids, d.mask, strict=True)]
        assert labels[row, : len(d.ids)].tolist() == want
        assert (labels[row, len(d.ids) :] == IGNORE).all()
        assert (input_ids[row, len(d.ids) :] == tokenizer.pad_token_id).all()


def test_tool_tokenizer_leaves_the_plain_one_alone():
    plain, tool = build_tokenizer(), build_tool_tokenizer()
    pv, tv = plain.get_vocab(), tool.get_vocab()
    assert len(pv) == len(tv) == 128
    # One slot renamed, every id kept: a plain demo model's weights load under either.
    assert {k: v for k, v in pv.items() if k != "<|reserved_0|>"} == {
        k: v for k, v in tv.items() if k != TOOL
    }
    assert pv["<|reserved_0|>"] == tv[TOOL]
    messages = [{"role": "user", "content": "Add: a1 b2"}]
    assert plain.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tool.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    with pytest.raises(Exception, match="only user and assistant roles"):
        plain.apply_chat_template([{"role": "tool", "content": "3"}], tokenize=False)


def test_logged_rewards_count_calls_and_well_formed_ones():
    good = call_text(PROBLEM) + "13\n\\boxed{13}"
    assert calls_tool(good, "13") == 1.0 and well_formed_call(good, "13") == 1.0
    assert calls_tool("\\boxed{13}", "13") == 0.0 and well_formed_call("\\boxed{13}", "13") == 0.0
    unclosed = '<tool_call>{"name": "calculator", "arguments": {"expression": "7+1"}}'
    bad_json = '<tool_call>{"name": "calculator", "arg</tool_call>'
    other = '<tool_call>{"name": "search", "arguments": {"expression": "7"}}</tool_call>'
    no_expression = '<tool_call>{"name": "calculator", "arguments": {"x": "7"}}</tool_call>'
    for response in (unclosed, bad_json, other, no_expression, good + unclosed):
        assert calls_tool(response, "13") == 1.0
        assert well_formed_call(response, "13") == 0.0, response


def test_format_penalty_hits_malformed_calls_on_training_rows_only():
    good = call_text(PROBLEM) + "13\n\\boxed{13}"
    bad_json = '<tool_call>{"name": "calculator", "arg</tool_call>'
    unclosed = '<tool_call>{"name": "calculator", "arguments": {"expression": "7+1"}}'
    train = {"extra_info": {"split": "train", "index": 3}}
    assert malformed_call_penalty(bad_json, "13", **train) == -1.0
    assert malformed_call_penalty(good + unclosed, "13", **train) == -1.0
    assert malformed_call_penalty(good, "13", **train) == 0.0
    assert malformed_call_penalty("\\boxed{13}", "13", **train) == 0.0
    # Validation rows (and untagged ones) score 0: val pass@1 stays correctness alone.
    for meta in ({"extra_info": {"split": "test"}}, {}, {"extra_info": None}, {"num_steps": 2}):
        assert malformed_call_penalty(bad_json, "13", **meta) == 0.0, meta


def test_rows_are_copied_with_their_split(tmp_path: Path):
    source = tmp_path / "rows.jsonl"
    rows = [
        {"prompt": "Add: a1 b2", "answer": "3"},
        {"prompt": "p", "answer": "4", "extra_info": {"k": 1}},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    copy_rows_with_split(source, tmp_path / "out.jsonl", "test")
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert got == [
        {"prompt": "Add: a1 b2", "answer": "3", "extra_info": {"split": "test"}},
        {"prompt": "p", "answer": "4", "extra_info": {"k": 1, "split": "test"}},
    ]


def test_quick_build_holds_a_loadable_model_data_and_tool_config(tmp_path: Path):
    assets = ensure_tool_demo_assets(tmp_path, recipe=ToolDemoRecipe.default(quick=True))
    assert assets.root.name == f"demo-tools-{ToolDemoRecipe.default(quick=True).key()}"
    assert [type(t).__name__ for t in load_tools(assets.tool_config)] == ["CalculatorTool"]
    assert assets.train_file.read_text() and assets.val_file.read_text()
    train_row = json.loads(assets.train_file.read_text().splitlines()[0])
    val_row = json.loads(assets.val_file.read_text().splitlines()[0])
    assert (
        train_row["extra_info"] == {"split": "train"} and val_row["extra_info"]["split"] == "test"
    )
    manifest = json.loads((assets.root / "demo.json").read_text())
    assert manifest["key"] == ToolDemoRecipe.default(quick=True).key()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    assert tok.convert_ids_to_tokens(6) == TOOL
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    # The plain demo it started from is the plain demo's own cached build, key unchanged.
    assert (tmp_path / f"demo-{ToolDemoRecipe.default(quick=True).base.key()}").is_dir()
    # A second call reuses the build.
    assert (
        ensure_tool_demo_assets(tmp_path, recipe=ToolDemoRecipe.default(quick=True)).manifest[
            "build_id"
        ]
        == manifest["build_id"]
    )
