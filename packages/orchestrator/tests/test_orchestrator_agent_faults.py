"""Tool faults (issue 46): a tool that raises, hangs past its deadline or answers at length, in
one run of many samples, costs each affected sample verl's error observation or a truncated
answer and the sample goes on, the run never waiting on the hung call; tools that all fail for
`reward.max_failed_steps` steps stop the run saying so (agent.tool_guard). The malformed call
and the unknown tool, one sample at a time, are test_orchestrator_agent_loop.py's.

The model is agent_scripted's tiny Llama: greedy, it calls the calculator, reads the answer
and answers. The tool is agent_scripted.FlakyTool: its calls raise, hang, answer 10,000
characters, answer "42", then only raise or hang.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_scripted import (
    ANSWER,
    CALL,
    MALFORMED,
    UNKNOWN,
    FlakyTool,
    hermes_tokenizer,
    save_scripted_model,
    tool_config,
)

from patrl.orchestrator.agent import AgentLoopRunner, ToolAgentLoop, ToolPool, load_tools
from patrl.orchestrator.agent.tool_guard import ToolFailureGuard, ToolsFailed
from patrl.rollout import Engine, EngineConfig, SamplingParams

FLAKY = "agent_scripted.FlakyTool"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    return save_scripted_model(root / "call", hermes_tokenizer(), CALL)


@pytest.fixture
def flaky() -> Iterator[None]:
    FlakyTool.reset()
    yield
    FlakyTool.gate.set()  # let the abandoned hung calls end


def test_raise_hang_and_huge_answers_in_one_run_each_cost_their_sample_only(
    model_dir: Path, tmp_path: Path, flaky: None
) -> None:
    eng = Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=512,
            max_model_len=1024,
        )
    )
    tools = load_tools(tool_config(tmp_path / "tools.yaml", FLAKY))
    pool = ToolPool(tools, timeout_s=0.5, max_response_length=20)
    loop = ToolAgentLoop(eng.tokenizer, pool, sorted(eng.eos_token_ids), response_length=400)
    questions = ["What is 6*7?", "Six times seven?", "Compute 6*7.", "6*7=?"]
    samples = [{"raw_prompt": [{"role": "user", "content": q}]} for q in questions]
    outs = AgentLoopRunner(eng, {"tool_agent": loop}).run(
        samples, SamplingParams(temperature=0, max_tokens=64)
    )
    tok = eng.tokenizer
    observations = []
    for out in outs:
        text = tok.decode(out.response_ids, skip_special_tokens=False)
        assert text.endswith(f"{ANSWER}<|im_end|>")  # every sample went on to its answer
        observations.append(text.split("<tool_response>\n", 1)[1].split("\n</tool_response>")[0])
    assert sorted(observations) == sorted(
        [
            "Error when executing tool: call 0 broke",
            "Error when executing tool: calculator timed out after 0.5s",
            "0123456789...(truncated)...0123456789",
            "42",
        ]
    )
    total = {k: sum(o.metrics[k] for o in outs) for k in outs[0].metrics}
    assert total == {
        "tool_calls": 4,
        "tool_errors": 2,
        "tool_truncated": 1,
        "tool_exceptions": 1,
        "tool_timeouts": 1,
    }
    assert pool.num_abandoned == 1 and not eng.has_unfinished()


def counters(calls: int, raised: int = 0, timed_out: int = 0, model: int = 0) -> dict[str, float]:
    """A step's summed multi_turn/* counters: `model` malformed / unknown-tool calls on top."""
    return {
        "multi_turn/tool_calls": float(calls + model),
        "multi_turn/tool_errors": float(raised + timed_out + model),
        "multi_turn/tool_exceptions": float(raised),
        "multi_turn/tool_timeouts": float(timed_out),
    }


def test_the_guard_stops_after_max_failed_steps_in_a_row_of_all_failed_calls() -> None:
    guard = ToolFailureGuard(3)
    assert guard.observe(1, counters(4, raised=4)) == (
        "step 1: every one of the 4 tool calls failed (4 raised, 0 timed out); each sample "
        "read an error observation instead of an answer (1 of reward.max_failed_steps=3)"
    )
    assert guard.observe(2, counters(4, raised=3)) is None  # one call answered: reset
    assert guard.observe(3, counters(4, raised=2, timed_out=2)) is not None
    # the model's own mistakes are not the tools': 2 calls reached a tool, both failed
    assert guard.observe(4, counters(2, timed_out=2, model=5)) is not None
    assert guard.observe(5, counters(0, model=3)) is None  # no call reached a tool: no change
    assert guard.observe(6, counters(0)) is None
    with pytest.raises(ToolsFailed) as err:
        guard.observe(7, counters(1, raised=1))
    assert "step 7: every one of the 1 tool calls failed" in str(err.value)
    assert "That is 3 steps in a row (reward.max_failed_steps=3): the run stops." in str(err.value)
    assert "rollout.multi_turn.tool_timeout_s" in str(err.value)


def test_the_guard_stops_a_short_run_whose_every_step_failed_at_its_last() -> None:
    guard = ToolFailureGuard(5)
    assert guard.observe(1, counters(2, raised=2)) is not None
    with pytest.raises(ToolsFailed, match="every step of this run with tool calls \\(2;"):
        guard.observe(2, counters(2, timed_out=2), last=True)
    mixed = ToolFailureGuard(5)
    assert mixed.observe(1, counters(2, raised=1)) is None
    assert mixed.observe(2, counters(2, raised=2), last=True) is not None  # one step answered
    with pytest.raises(ValueError, match="max_failed_steps must be >= 1"):
        ToolFailureGuard(0)


@pytest.mark.e2e
def test_a_job_whose_calls_and_tools_fail_goes_on_then_stops_saying_so(
    tmp_path: Path, flaky: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model's calls are well-formed, malformed or name an unknown tool, each as likely;
    the first 4 that reach the tool raise, hang, answer at length and answer, the later ones
    only raise or hang. The job trains on through all of them (the model's mistakes never
    count against the tools), and stops once every call that reached the tool failed for
    reward.max_failed_steps=2 steps in a row: exit code 1, never waiting on a hung call."""
    from patrl.orchestrator.main import main

    model_dir = save_scripted_model(
        tmp_path / "mixed", hermes_tokenizer(), CALL, other_calls=(MALFORMED, UNKNOWN)
    )

    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"What is {a}*7?", "answer": str(7 * a)} for a in range(2, 6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    overrides: dict[str, Any] = {
        "model.path": model_dir,
        "data.train_files": data,
        "data.train_batch_size": 2,
        "data.max_prompt_length": 512,
        "data.max_response_length": 200,
        "actor.ppo_mini_batch_size": 2,
        "rollout.n": 2,
        "rollout.temperature": 0.05,  # the scripted calls, nearly always
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 512,
        "rollout.adaptive_tp.enable": "false",
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.tool_config_path": tool_config(tmp_path / "tools.yaml", FLAKY),
        "rollout.multi_turn.max_assistant_turns": 2,
        "rollout.multi_turn.tool_timeout_s": 0.5,
        "rollout.multi_turn.max_tool_response_length": 64,
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
        "reward.num_workers": 0,
        "reward.max_failed_steps": 2,
        "trainer.total_training_steps": 12,
        "trainer.save_freq": 0,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": run,
    }
    assert main([f"{k}={v}" for k, v in overrides.items()]) == 1
    err = capsys.readouterr().err
    assert "patrl: error: step " in err  # the first all-failed step, said as it happens
    assert "tool calls failed" in err
    assert "That is 2 steps in a row (reward.max_failed_steps=2): the run stops." in err
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "actor/pg_loss" in r]
    assert 1 <= len(steps) < 12  # stopped before the run's end
    total = {k: sum(r[f"multi_turn/{k}"] for r in steps) for k in ("tool_calls", "tool_errors")}
    for key in ("tool_exceptions", "tool_timeouts", "tool_truncated"):
        total[key] = sum(r[f"multi_turn/{key}"] for r in steps)
        assert total[key] >= 1, key
    # malformed and unknown-tool calls were answered too, and the steps went on
    assert total["tool_errors"] > total["tool_exceptions"] + total["tool_timeouts"]
    assert total["tool_calls"] > total["tool_errors"]  # the huge answer and "42"
