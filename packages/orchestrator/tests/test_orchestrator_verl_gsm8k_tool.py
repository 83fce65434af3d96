"""verl's GSM8K multi-turn tool example in patrl (issue 46): verl's command line
(examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh), its Hydra config
(gsm8k_multiturn_grpo.yaml) and its tool config (gsm8k_tool_config.yaml, the class name changed
to patrl's port), over data laid out as verl's gsm8k_multiturn_w_tool.py preprocessing writes
it, dry-run to the same values and run 2 steps; the ported Gsm8kTool behaves as verl's.

The model is agent_scripted's tiny Llama that calls `calc_gsm8k_reward` with answer 42, reads
the tool's answer and answers; rows' ground truths alternate 42 and 41, so the tool answers
reward=1.0 and reward=0.0.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_scripted import hermes_tokenizer, save_scripted_model

from patrl.orchestrator.agent import load_tools
from patrl.orchestrator.agent.gsm8k_tool import Gsm8kTool, gsm8k_answer, gsm8k_score
from patrl.orchestrator.main import main

# volcengine/verl at commit b178a3c: examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh,
# its python3 command verbatim but for the model ($MODEL) and the experiment name, whose
# $(now) would vary by the minute.
VERL_GSM8K_MULTITURN = r"""
python3 -m verl.trainer.main_ppo \
    --config-path="$CONFIG_PATH" \
    --config-name='gsm8k_multiturn_grpo' \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path=$MODEL \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    global_profiler.tool=torch_memory \
    global_profiler.save_path=./mem_snapshots \
    global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000 \
    global_profiler.global_tool_config.torch_memory.stack_depth=32 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.85 \
    actor_rollout_ref.rollout.multi_stage_wake_up=True \
    actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    actor_rollout_ref.rollout.over_sample_rate=0.1 \
    actor_rollout_ref.rollout.mode=async \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='multi-turn-grpo-qwen2.5-3b-sglang' \
    trainer.experiment_name=$EXPERIMENT_NAME \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=20 \
    trainer.val_before_train=True \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$PROJECT_DIR/examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml" \
    trainer.total_epochs=15 $@
"""
# its Hydra config, examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml, verbatim
GSM8K_MULTITURN_GRPO = """\
hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""
# its tool config, config/tool_config/gsm8k_tool_config.yaml: verl's class name
# verl.tools.gsm8k_tool.Gsm8kTool becomes patrl's port
GSM8K_TOOL_CONFIG = """\
tools:
  - class_name: "patrl.orchestrator.agent.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""
# verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py's system turn and instruction
SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. "
    "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
    "before generate final answer at least once and refine your answer if necessary. "
    "Put your final answer in the format of `#### <answer>`."
)
INSTRUCTION = "Let's think step by step and output the final answer after `####`."
CALL = '{"name": "calc_gsm8k_reward", "arguments": {"answer": "42"}}'
NUM_TRAIN, NUM_TEST = 260, 4  # one batch of verl's 256 a epoch


def gsm8k_rows(split: str, count: int) -> list[dict[str, Any]]:
    """Rows as gsm8k_multiturn_w_tool.py writes them; ground truths alternate 42 and 41."""
    rows = []
    for idx in range(count):
        truth = str(42 - idx % 2)
        question_raw = f"Tom has {truth} marbles. How many marbles does he have?"
        question = question_raw + " " + INSTRUCTION
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {
                    "split": split,
                    "index": idx,
                    "answer": f"He has {truth} marbles.\n#### {truth}",
                    "question": question_raw,
                    "need_tools_kwargs": True,
                    "tools_kwargs": {
                        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}},
                    },
                    "interaction_kwargs": {"query": question, "ground_truth": truth},
                },
            }
        )
    return rows


@pytest.fixture
def verl_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """verl's layout under tmp_path ($PROJECT_DIR: the configs; $HOME/data/gsm8k: the data),
    the scripted model, the run's cwd; the shell variables of the script."""
    import datasets

    project, home = tmp_path / "verl", tmp_path / "home"
    config = project / "examples" / "sglang_multiturn" / "config"
    (config / "tool_config").mkdir(parents=True)
    (config / "gsm8k_multiturn_grpo.yaml").write_text(GSM8K_MULTITURN_GRPO)
    (config / "tool_config" / "gsm8k_tool_config.yaml").write_text(GSM8K_TOOL_CONFIG)
    (home / "data" / "gsm8k").mkdir(parents=True)
    for split, count in (("train", NUM_TRAIN), ("test", NUM_TEST)):
        path = home / "data" / "gsm8k" / f"{split}.parquet"
        datasets.Dataset.from_list(gsm8k_rows(split, count)).to_parquet(str(path))
    model = save_scripted_model(
        tmp_path / "model", hermes_tokenizer([CALL]), CALL, max_position_embeddings=2048
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as where it is missing
    return {
        "PROJECT_DIR": str(project),
        "CONFIG_PATH": str(config),
        "HOME": str(home),
        "MODEL": str(model),
        "EXPERIMENT_NAME": "qwen2.5-3b_baseline",
    }


def verl_args(env: dict[str, str], extra: list[str]) -> list[str]:
    """The script's arguments as the shell hands them to verl's main_ppo, `extra` as $@."""
    text = VERL_GSM8K_MULTITURN.replace("$@", " ".join(shlex.quote(e) for e in extra))
    for name in sorted(env, key=len, reverse=True):
        text = text.replace(f"${name}", env[name])
    words = shlex.split(text.replace("\\\n", " "))
    assert words[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    return words[3:]


# What patrl needs on top of verl's line, as a verl user passes it ($@): the multi-turn sync
# schedule at static TP 1 (rollout.adaptive_tp.enable is patrl's, on by default); verl's
# over_sample_rate=0.1 is patrl's partial rollouts, which run with tools.
PATRL_EXTRA = ["rollout.adaptive_tp.enable=false"]


def test_verls_gsm8k_multiturn_command_line_dry_runs_to_the_same_values(
    verl_project: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")  # verl's trainer.n_gpus_per_node=8 trainer.nnodes=1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert main(["--dry-run", *verl_args(verl_project, PATRL_EXTRA)]) == 0
    out = capsys.readouterr()
    c = yaml.safe_load(out.out)
    data = Path(verl_project["HOME"]) / "data" / "gsm8k"
    tools = (
        f"{verl_project['PROJECT_DIR']}/examples/sglang_multiturn/config/tool_config/"
        "gsm8k_tool_config.yaml"
    )
    expected = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,
        "data.train_batch_size": 256,
        "data.max_prompt_length": 1024,
        "data.max_response_length": 1024,
        "data.filter_overlong_prompts": True,
        "data.truncation": "error",
        "data.train_files": str(data / "train.parquet"),
        "data.val_files": str(data / "test.parquet"),
        "model.path": verl_project["MODEL"],
        "actor.optim.lr": 1e-6,
        "actor.use_remove_padding": True,
        "actor.ppo_mini_batch_size": 256,
        "actor.ppo_micro_batch_size_per_gpu": 32,
        "actor.use_kl_loss": True,
        "actor.kl_loss_coef": 0.001,
        "actor.kl_loss_type": "low_var_kl",
        "actor.entropy_coeff": 0,
        "actor.enable_gradient_checkpointing": True,
        "rollout.tensor_model_parallel_size": 1,
        "rollout.gpu_memory_utilization": 0.85,
        "rollout.n": 16,
        "rollout.over_sample_rate": 0.1,
        "rollout.adaptive_tp.enable": False,  # PATRL_EXTRA's
        # the Hydra config's
        "rollout.multi_turn.enable": True,
        "rollout.multi_turn.max_assistant_turns": 5,
        "rollout.multi_turn.tool_config_path": tools,
        # verl's multi_turn defaults where nothing sets them
        "rollout.multi_turn.max_user_turns": None,
        "rollout.multi_turn.max_parallel_calls": 1,
        "rollout.multi_turn.max_tool_response_length": 256,
        "rollout.multi_turn.tool_response_truncate_side": "middle",
        "rollout.multi_turn.format": "hermes",
        "trainer.critic_warmup": 0,
        "trainer.logger": ["console", "wandb"],
        "trainer.project_name": "multi-turn-grpo-qwen2.5-3b-sglang",
        "trainer.experiment_name": "qwen2.5-3b_baseline",
        "trainer.n_gpus_per_node": 8,
        "trainer.nnodes": 1,
        "trainer.save_freq": -1,
        "trainer.test_freq": 20,
        "trainer.val_before_train": True,
        "trainer.total_epochs": 15,
    }
    for key, value in expected.items():
        node: Any = c
        for part in key.split("."):
            node = node[part]
        assert node == value, f"{key}: {node!r} != {value!r}"
    assert "unknown key" not in out.err


def test_a_hydra_config_with_other_defaults_is_refused_naming_them(
    verl_project: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    config = Path(verl_project["CONFIG_PATH"])
    text = GSM8K_MULTITURN_GRPO.replace("  - ppo_trainer", "  - ppo_megatron_trainer")
    (config / "megatron.yaml").write_text(text)
    args = ["--dry-run", f"--config-path={config}", "--config-name=megatron"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "megatron.yaml: defaults ['ppo_megatron_trainer'] are not verl's ppo_trainer" in err
    assert main(["--dry-run", f"--config-path={config}", "--config-name=nothere"]) == 2
    assert "nothere.yaml" in capsys.readouterr().err


def test_the_command_line_overrides_the_hydra_config(
    verl_project: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    config = Path(verl_project["CONFIG_PATH"])
    train = Path(verl_project["HOME"]) / "data" / "gsm8k" / "train.parquet"
    (config / "mine.yaml").write_text(
        "defaults: [ppo_trainer, _self_]\n"
        f"data: {{max_prompt_length: 1024, train_files: {train}}}\n"
        f"actor_rollout_ref: {{model: {{path: {verl_project['MODEL']}}}, "
        "rollout: {n: 3, adaptive_tp: {enable: false}}}\n"
        "trainer: {logger: [console]}\n"
    )
    hydra = [f"--config-path={config}", "--config-name=mine"]

    def dry_run(*overrides: str) -> Any:
        assert main(["--dry-run", *hydra, *overrides]) == 0
        return yaml.safe_load(capsys.readouterr().out)

    plain = dry_run()
    assert plain["rollout"]["n"] == 3 and plain["trainer"]["logger"] == ["console"]
    assert plain["rollout"]["adaptive_tp"]["enable"] is False
    assert dry_run("actor_rollout_ref.rollout.n=5")["rollout"]["n"] == 5


@pytest.mark.e2e
def test_verls_gsm8k_multiturn_command_line_runs_two_steps(
    verl_project: dict[str, str],
) -> None:
    """The same line on one CPU process, shrunk through $@ as a verl user would."""
    small = [
        *PATRL_EXTRA,
        "trainer.n_gpus_per_node=1",
        "data.train_batch_size=2",
        "data.max_response_length=160",  # a call, the tool's answer, the model's answer
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.temperature=0.05",  # the scripted call, nearly always
        "actor_rollout_ref.rollout.num_kv_blocks=512",
        "actor_rollout_ref.rollout.block_size=4",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=False",
        "trainer.logger=['console']",
        "reward.num_workers=0",
    ]
    assert main(verl_args(verl_project, small)) == 0
    run = Path("runs") / "multi-turn-grpo-qwen2.5-3b-sglang" / "qwen2.5-3b_baseline"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["multi_turn/tool_calls"] > 0
        assert r["multi_turn/tool_errors"] == 0  # the gsm8k tool answered every call
        assert r["multi_turn/tool_tokens/mean"] > 0
        assert r["multi_turn/num_turns/mean"] > 2  # the model went on after the tool's answer
        assert all(r[k] == r[k] for k in ("actor/pg_loss", "critic/score/mean"))  # not NaN


def test_each_rows_ground_truth_reaches_the_tool_through_its_tools_kwargs(
    verl_project: dict[str, str],
) -> None:
    """The parquet rows' extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth,
    read as the job reads data.train_files, is the tool instance's: the same call (answer 42)
    is right for row 0 (truth 42) and wrong for row 1 (truth 41)."""
    from patrl.orchestrator.agent.multi_turn import MultiTurnRollout
    from patrl.orchestrator.config import load_config
    from patrl.orchestrator.data import dataset_for
    from patrl.rollout import Engine, EngineConfig, SamplingParams

    tools = Path(verl_project["CONFIG_PATH"]) / "tool_config" / "gsm8k_tool_config.yaml"
    train = Path(verl_project["HOME"]) / "data" / "gsm8k" / "train.parquet"
    config = load_config(
        None,
        [
            f"data.train_files={train}",
            "data.max_prompt_length=1024",
            "data.max_response_length=160",
            "rollout.adaptive_tp.enable=false",
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.tool_config_path={tools}",
        ],
    )
    engine = Engine(
        EngineConfig(
            model=verl_project["MODEL"],
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=512,
            max_model_len=2048,
        )
    )
    items = dataset_for(config, engine.tokenizer, str(train)).items[:2]
    assert [i.extra["extra_info"]["need_tools_kwargs"] for i in items] == [True, True]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=160, seed=0)
    right, wrong = MultiTurnRollout(config, engine).generate(items, [greedy, greedy])
    assert "Current parsed answer='42' reward=1.0" in right.outputs[0].text
    assert "Current parsed answer='42' reward=0.0" in wrong.outputs[0].text


def run_tool(tool: Gsm8kTool, create_kwargs: dict[str, Any], answers: list[Any]) -> list[Any]:
    """verl's ToolAgentLoop's calls on one instance: create(create_kwargs=...), execute per
    answer, calc_reward, release."""

    async def calls() -> list[Any]:
        instance_id, _ = await tool.create(create_kwargs=create_kwargs)
        out = [await tool.execute(instance_id, {"answer": a}) for a in answers]
        out.append(await tool.calc_reward(instance_id))
        await tool.release(instance_id)
        return out

    return asyncio.run(calls())


def test_the_ported_gsm8k_tool_behaves_as_verls(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(GSM8K_TOOL_CONFIG)
    (tool,) = load_tools(path)
    assert isinstance(tool, Gsm8kTool) and tool.name == "calc_gsm8k_reward"
    first, second, third, final = run_tool(tool, {"ground_truth": "72"}, ["70", "72", 72])
    # verl's texts and step rewards: no improvement costs 0.05
    assert (first[0].text, first[1]) == ("Current parsed answer='70' reward=0.0", -0.05)
    assert (second[0].text, second[1]) == ("Current parsed answer='72' reward=1.0", 0.0)
    assert (third[0].text, third[1]) == ("Current parsed answer='72' reward=1.0", -0.05)
    assert final == 1.0

    async def direct() -> tuple[str, float]:
        # a ground truth given directly wins over create_kwargs (verl's create signature)
        instance_id, _ = await tool.create(
            "mine", ground_truth="5", create_kwargs={"ground_truth": "6"}
        )
        response, _, _ = await tool.execute(instance_id, {"answer": "5"})
        await tool.release(instance_id)
        with pytest.raises(KeyError):  # released: the instance is gone
            await tool.calc_reward(instance_id)
        return instance_id, await asyncio.sleep(0, response.text)

    assert asyncio.run(direct()) == ("mine", "Current parsed answer='5' reward=1.0")


@pytest.mark.parametrize(
    ("solution", "method", "answer"),
    [
        ("so #### 1,234 dollars", "strict", "1234"),
        ("#### 3 then #### -4.5", "strict", "-4.5"),
        ("the answer is 12", "strict", None),
        ("the answer is 12 .", "flexible", "12"),
        ("x" * 400 + " 7", "flexible", "7"),
        ("#### 9" + "x" * 400, "strict", None),  # only the last 300 characters are read
        ("no numbers", "flexible", None),
    ],
)
def test_gsm8k_answers_are_read_as_verls_scorer_reads_them(
    solution: str, method: str, answer: str | None
) -> None:
    assert gsm8k_answer(solution, method) == answer
    expected = 0.0 if answer is None else (1.0 if answer == "12" else 0.5)
    assert gsm8k_score(solution, "12", method, format_score=0.5) == expected
