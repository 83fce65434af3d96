"""Multi-turn rollouts composed with the rest of patrl (issue 46): a data row's `agent_name`
picks its registered agent loop (verl's per-sample selection); at static TP 2 the group's
first rank runs the loops and tools and drives its peer, which samples what TP 1 samples.

The model is agent_scripted's tiny Llama: greedy, it calls the calculator, reads the answer
and answers, so a tool_agent trajectory holds model tokens, tool tokens, then model tokens.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_scripted import CALL, hermes_tokenizer, save_scripted_model, tool_config

from patrl.orchestrator.agent import (
    AgentLoop,
    AgentLoopOutput,
    BaseTool,
    ToolResponse,
    register,
)
from patrl.orchestrator.agent.multi_turn import MultiTurnRollout, agent_loop_classes
from patrl.orchestrator.config import JobConfig, load_config
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.preflight import PreflightError, check, multi_turn_problems
from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl_testkit.multirank import run_ranks

CALCULATOR = "patrl.orchestrator.agent.calculator.CalculatorTool"
QUESTION = [{"role": "user", "content": "What is 6*7?"}]
GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=64, seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_scripted_model(tmp_path_factory.mktemp("mtc") / "call", hermes_tokenizer(), CALL)


def job(tools: Path, *overrides: str) -> JobConfig:
    return load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            "data.max_response_length=64",
            "rollout.n=2",
            "rollout.adaptive_tp.enable=false",
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.tool_config_path={tools}",
            *overrides,
        ],
    )


def engine_of(model_dir: Path) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=512,
            max_model_len=1024,
        )
    )


class PrefixAgentLoop(AgentLoop):
    """A job's own loop (named by an agent loop config YAML): one turn over the raw prompt's
    last message's text, encoded as is (no chat template), at most 5 tokens."""

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        prompt = list(self.tokenizer.encode(kwargs["raw_prompt"][-1]["content"] + "\n"))
        turn = await self.server_manager.generate(
            f"prefix-{kwargs['sample_index']}",
            prompt_ids=prompt,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=5),
        )
        return AgentLoopOutput(
            prompt, turn.token_ids, [1] * len(turn.token_ids), turn.log_probs, num_turns=7
        )


@register("decorated_agent")
class DecoratedAgentLoop(PrefixAgentLoop):
    """A loop registered by verl's decorator (its module imported)."""


def item(index: int, **extra: Any) -> PromptItem:
    return PromptItem(index, [], "What is 6*7?", "42", extra, QUESTION)


def test_a_rows_agent_name_picks_its_registered_loop(tmp_path: Path, model_dir: Path) -> None:
    loops = tmp_path / "agent_loops.yaml"
    target = f"{__name__}.PrefixAgentLoop"
    loops.write_text(yaml.safe_dump([{"name": "prefix_agent", "_target_": target}]))
    config = job(
        tool_config(tmp_path / "tools.yaml", CALCULATOR),
        f"rollout.agent.agent_loop_config_path={loops}",
    )
    names = agent_loop_classes(config)
    assert {"tool_agent", "single_turn_agent", "prefix_agent", "decorated_agent"} <= set(names)
    engine = engine_of(model_dir)
    rollout = MultiTurnRollout(config, engine)
    items = [
        item(0),  # no agent_name: verl's default, tool_agent
        item(1, agent_name="single_turn_agent"),
        item(2, agent_name="prefix_agent"),
        item(3, agent_name="tool_agent"),
        item(4, agent_name="decorated_agent"),
    ]
    outs = rollout.generate(items, [GREEDY] * len(items))
    tool_default, single, prefix, tool_named, decorated = (o.outputs[0] for o in outs)
    # tool_agent: the tools' schemas in the prompt, a tool turn in the response
    assert outs[0].prompt_token_ids == rollout.loop.prompt_ids(QUESTION)
    assert 0 in (tool_default.response_mask or []) and "42" in tool_default.text
    assert tool_named.token_ids == tool_default.token_ids
    # single_turn_agent: the slow twin is the engine's greedy turn over the template's prompt
    tok = engine.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    (twin,) = engine_of(model_dir).generate([prompt], GREEDY)
    assert outs[1].prompt_token_ids == prompt
    assert single.token_ids == list(twin.outputs[0].token_ids)
    assert single.response_mask == [1] * len(single.token_ids)
    # the job's own loops: their prompts and budgets
    for out, got in ((outs[2], prefix), (outs[4], decorated)):
        assert out.prompt_token_ids == tok.encode("What is 6*7?\n")
        assert 0 < len(got.token_ids) <= 5 and got.response_mask == [1] * len(got.token_ids)
    assert rollout.metrics["multi_turn/num_turns/mean"] > 0


def test_an_unknown_agent_name_is_an_error_naming_the_value_and_the_registered_names(
    tmp_path: Path, model_dir: Path
) -> None:
    config = job(tool_config(tmp_path / "tools.yaml", CALCULATOR))
    rollout = MultiTurnRollout(config, engine_of(model_dir))
    with pytest.raises(ValueError, match=r"row 5: agent_name='react_agent' is not a registered"):
        rollout.generate([item(4), item(5, agent_name="react_agent")], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match=r"registered: \[.*'single_turn_agent', 'tool_agent'"):
        rollout.generate([item(5, agent_name=["a list"])], [GREEDY])

    # preflight reads the rows: the train file's unknown name, with the registered names
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "What is 6*7?", "answer": "42", "agent_name": "tool_agent"}]
    rows += [{"prompt": "What is 2*7?", "answer": "14", "agent_name": "react_agent"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = job(
        tool_config(tmp_path / "tools.yaml", CALCULATOR),
        f"model.path={model_dir}",
        f"data.train_files={data}",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "data.max_prompt_length=512",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    with pytest.raises(PreflightError) as e:
        check(bad, 1)
    (problem,) = [p for p in e.value.problems if "agent_name" in p]
    assert problem.startswith("data.train_files: row 1: agent_name='react_agent'"), problem
    assert "'tool_agent'" in problem and "'single_turn_agent'" in problem


@pytest.mark.parametrize(
    ("entries", "named"),
    [
        ("- {name: x, _target_: no_such_module.Loop}", "0._target_='no_such_module.Loop': cannot"),
        ("- {name: x, _target_: json.JSONDecoder}", "is not a subclass of"),
        ("- {_target_: json.JSONDecoder}", "0.name is missing"),
        ("{name: x}", "is a list of {name, _target_}"),
    ],
)
def test_an_agent_loop_config_that_does_not_load_is_a_preflight_error(
    tmp_path: Path, entries: str, named: str
) -> None:
    loops = tmp_path / "agent_loops.yaml"
    loops.write_text(entries)
    config = job(
        tool_config(tmp_path / "tools.yaml", CALCULATOR),
        f"rollout.agent.agent_loop_config_path={loops}",
    )
    (problem,) = multi_turn_problems(config)
    assert problem.startswith(f"rollout.agent.agent_loop_config_path: {loops}: "), problem
    assert named in problem, problem


# ------------------------------------------------------------------------- static TP > 1


class PidTool(BaseTool):
    """Nondeterministic: answers with its process id and a random number, and counts its
    calls in this process."""

    calls = 0

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        PidTool.calls += 1
        time.sleep(0.05)  # the group's peer waits: the heartbeat path (HEARTBEAT_S is 0)
        return ToolResponse(text=f"{os.getpid()}-{random.random()}"), 0.0, {}


@register("raising_agent")
class RaisingAgentLoop(AgentLoop):
    """Generates one turn, then raises (on the TP group's first rank, where loops run)."""

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        prompt = list(self.tokenizer.encode("What is 6*7?\n"))
        await self.server_manager.generate(
            f"raising-{kwargs['sample_index']}",
            prompt_ids=prompt,
            sampling_params=SamplingParams(max_tokens=3),
        )
        raise RuntimeError("the loop broke")


def _tp_rollout(
    rank: int, world_size: int, model_dir: str, tools: str, pid_tools: str
) -> dict[str, Any]:
    import torch.distributed as dist

    from patrl.orchestrator.agent import agent_loop
    from patrl.tpreshard import ParallelLayout

    agent_loop.HEARTBEAT_S = 0.0  # every wait on a tool pings the peer
    group = dist.new_group(list(range(world_size)))
    layout = ParallelLayout(tp_size=world_size, tp_rank=rank, tp_group=group)
    engine = Engine(
        EngineConfig(
            model=model_dir,
            dtype="float32",
            block_size=4,
            num_kv_blocks=512,
            max_model_len=1024,
        ),
        layout,
    )
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=64, seed=3)
    calculator = MultiTurnRollout(job(Path(tools)), engine)
    out = calculator.generate([item(0), item(1, agent_name="single_turn_agent")], [greedy] * 2)
    result: dict[str, Any] = {
        "tokens": [[c.token_ids for c in o.outputs] for o in out],
        "masks": [[c.response_mask for c in o.outputs] for o in out],
        "tool_calls": calculator.metrics.get("multi_turn/tool_calls"),
    }
    random_tool = MultiTurnRollout(job(Path(pid_tools)), engine)
    out = random_tool.generate([item(2)], [greedy])
    result["random_text"] = [c.text for c in out[0].outputs]
    result["pid_tool_calls"] = PidTool.calls
    try:  # a loop that raises on the first rank: every rank raises, no rank hangs
        random_tool.generate([item(3, agent_name="raising_agent")], [greedy])
    except RuntimeError as e:
        result["error"] = str(e)
    result["idle_after_error"] = not engine.has_unfinished()
    out = calculator.generate([item(4)], [greedy])  # and the group goes on in step
    result["after_error"] = [c.token_ids for c in out[0].outputs]
    return result


@pytest.mark.multirank
def test_tp2_runs_tools_once_per_group_and_samples_what_tp1_samples(
    tmp_path: Path, model_dir: Path
) -> None:
    tools = tool_config(tmp_path / "tools.yaml", CALCULATOR)
    pid_tools = tool_config(tmp_path / "pid.yaml", f"{__name__}.PidTool")
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=64, seed=3)
    tp1 = MultiTurnRollout(job(tools), engine_of(model_dir))
    out = tp1.generate([item(0), item(1, agent_name="single_turn_agent")], [greedy] * 2)
    expected = [[c.token_ids for c in o.outputs] for o in out]
    expected_masks = [[c.response_mask for c in o.outputs] for o in out]
    assert 0 in expected_masks[0][0]  # a tool turn in the trajectory

    leader, peer = run_ranks(
        _tp_rollout,
        world_size=2,
        args=(str(model_dir), str(tools), str(pid_tools)),
        timeout_s=300,
    )
    for rank in (leader, peer):
        assert rank["tokens"] == expected and rank["masks"] == expected_masks
        assert rank["tool_calls"] == 2.0  # the group's calls, on every rank's metrics
        assert rank["after_error"] == expected[0]
        assert rank["idle_after_error"]
    # the random tool ran on the first rank only, and both ranks hold its answers
    assert leader["pid_tool_calls"] == 2 and peer["pid_tool_calls"] == 0
    assert leader["random_text"] == peer["random_text"]
    assert leader["random_text"][0] != leader["random_text"][1]  # two calls, two answers
    assert leader["error"] == "the loop broke"
    assert peer["error"].startswith("the TP group's first rank failed its agent loops: ")
    assert "RuntimeError: the loop broke" in peer["error"]
