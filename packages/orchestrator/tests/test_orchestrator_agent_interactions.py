"""verl's interactions in the tool agent loop (`rollout.multi_turn.interaction_config_path`): a
simulated user answers the model's final turn, its answer is appended as a user message's
tokens (mask 0, the KV extended), turn scores reach the reward as verl passes them,
`max_user_turns` caps the attempts, faults end the sample and never hang, preflight names bad
configs and rows, a verl-style command line dry-runs to the same values, and a job runs 2 steps.

The model is agent_scripted's tiny Llama under RETRY_TEMPLATE: greedy, its first answer is
WRONG, and its answer after a user message that follows the first one is RIGHT (or WRONG
again, for the cap); the interaction is the GSM8K port, ground truth 42.
"""

from __future__ import annotations

import json
import shlex
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_scripted import RETRY_TEMPLATE, hermes_tokenizer, save_scripted_model
from test_orchestrator_agent_loop import Recorder
from test_orchestrator_verl_gsm8k_tool import verl_project  # noqa: F401 (a fixture)

from patrl.orchestrator.agent import AgentLoopRunner, ToolAgentLoop, ToolPool
from patrl.orchestrator.agent.agent_loop import TurnState
from patrl.orchestrator.agent.gsm8k_interaction import INCORRECT, Gsm8kInteraction
from patrl.orchestrator.agent.interaction import (
    BaseInteraction,
    InteractionConfigError,
    load_interactions,
)
from patrl.orchestrator.agent.multi_turn import MultiTurnRollout
from patrl.orchestrator.config import load_config
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.preflight import multi_turn_problems
from patrl.orchestrator.rewards import RewardManager
from patrl.orchestrator.scoring import score_outputs
from patrl.orchestrator.support import unsupported
from patrl.rollout import Engine, EngineConfig, SamplingParams

WRONG, RIGHT = "#### 41", "#### 42"
GREEDY = SamplingParams(temperature=0, max_tokens=64)
QUESTION = [{"role": "user", "content": "What is 6*7?"}]
PORT = "patrl.orchestrator.agent.gsm8k_interaction.Gsm8kInteraction"
# verl's examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml,
# the class name changed to patrl's port
GSM8K_INTERACTION_CONFIG = f"""\
interaction:
  - name: "gsm8k"
    class_name: "{PORT}"
    config: {{}}
"""
KWARGS = {"name": "gsm8k", "query": "What is 6*7?", "ground_truth": "42"}


def tokenizer() -> Any:
    tok = hermes_tokenizer([WRONG, RIGHT])
    tok.chat_template = RETRY_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("interactions")
    return {
        "retry": save_scripted_model(root / "retry", tokenizer(), None, RIGHT, first_answer=WRONG),
        "stuck": save_scripted_model(root / "stuck", tokenizer(), None, WRONG),
    }


def engine(model: Path) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=512,
            max_model_len=1024,
        )
    )


class Recording(Gsm8kInteraction):
    """The GSM8K port, recording each call (and each generate_response's messages)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.calls: list[tuple[str, Any]] = []

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        self.calls.append(("start", dict(kwargs)))
        return await super().start_interaction(instance_id, **kwargs)

    async def generate_response(self, instance_id: str, messages: Any, **kwargs: Any) -> Any:
        self.calls.append(("respond", [dict(m) for m in messages]))
        return await super().generate_response(instance_id, messages, **kwargs)

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.calls.append(("finalize", instance_id))
        await super().finalize_interaction(instance_id, **kwargs)


def loop_of(eng: Engine, interaction: BaseInteraction, **keys: Any) -> ToolAgentLoop:
    keys.setdefault("response_length", 400)
    return ToolAgentLoop(
        eng.tokenizer,
        ToolPool([]),
        sorted(eng.eos_token_ids),
        interactions={"gsm8k": interaction},
        **keys,
    )


def run_one(model: Path, interaction: BaseInteraction, **keys: Any) -> Any:
    eng = engine(model)
    loop = loop_of(eng, interaction, **keys)
    runner = AgentLoopRunner(eng, {"tool_agent": loop})
    rec = Recorder(runner, loop)
    (out,) = runner.run([{"raw_prompt": QUESTION, "interaction_kwargs": dict(KWARGS)}], GREEDY)
    assert eng.kept_request_ids() == [] and not eng.has_unfinished()
    return out, rec, loop, eng.tokenizer


def test_a_wrong_then_right_answer_gets_the_users_turn_as_tokens_and_the_kv_extended(
    models: dict[str, Path],
) -> None:
    interaction = Recording({"name": "gsm8k"})
    out, rec, loop, tok = run_one(models["retry"], interaction)
    (_, first, _), (_, second, _) = rec.turns
    assert tok.decode(first, skip_special_tokens=True) == WRONG
    assert tok.decode(second, skip_special_tokens=True) == RIGHT
    user = loop.appended_ids([{"role": "user", "content": INCORRECT}], ended_with_eos=True)
    # tokens in, tokens out: the model's turns and the user turn's ids, position by position
    assert out.response_ids == first + user + second
    assert out.response_mask == [1] * len(first) + [0] * len(user) + [1] * len(second)
    assert out.response_logprobs[len(first) : len(first) + len(user)] == [0.0] * len(user)
    assert tok.decode(user).startswith("\n<|im_start|>user\n" + INCORRECT + "<|im_end|>")
    # the KV is extended: the second turn prefills the user turn and the last sampled token
    _, (submitted, prefilled) = rec.prefill
    assert prefilled == len(user) + 1 and submitted > prefilled
    assert out.extra_fields["turn_scores"] == [0.0, 1.0]
    assert out.num_turns == 2 + 1 + 1  # two model turns, one user turn, the prompt
    assert out.metrics["interaction_turns"] == 1 and out.metrics["interaction_errors"] == 0
    # verl's calls: start with the row's whole interaction_kwargs, the conversation as
    # messages (the model's turns decoded), finalize once
    kinds = [k for k, _ in interaction.calls]
    assert kinds == ["start", "respond", "respond", "finalize"]
    assert interaction.calls[0][1] == KWARGS
    assert interaction.calls[2][1] == [
        *QUESTION,
        {"role": "assistant", "content": WRONG},
        {"role": "user", "content": INCORRECT},
        {"role": "assistant", "content": RIGHT},
    ]


def test_max_user_turns_caps_the_attempts(models: dict[str, Path]) -> None:
    interaction = Recording({"name": "gsm8k"})
    out, rec, _, _ = run_one(models["stuck"], interaction, max_user_turns=2)
    assert [k for k, _ in interaction.calls].count("respond") == 2  # verl's rule: not after
    assert len(rec.turns) == 3 and out.metrics["interaction_turns"] == 2
    assert out.extra_fields["turn_scores"] == [0.0, 0.0]
    assert out.response_mask[-1] == 1  # never ends on a user turn


def test_the_turn_scores_reach_the_reward_as_verls_extra_info(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    path = tmp_path / "interaction.yaml"
    path.write_text(GSM8K_INTERACTION_CONFIG)
    config = load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            "data.max_response_length=256",  # the user's answer is ~100 character tokens
            "rollout.n=2",
            "rollout.adaptive_tp.enable=false",
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.interaction_config_path={path}",
            "actor.ppo_mini_batch_size=1",
            "data.train_batch_size=1",
        ],
    )
    rollout = MultiTurnRollout(config, engine(models["retry"]))
    extra = {"extra_info": {"index": 3, "interaction_kwargs": dict(KWARGS)}}
    item = PromptItem(7, [], "What is 6*7?", "42", extra, QUESTION)
    (out,) = rollout.generate([item], [SamplingParams(n=2, temperature=0.0, max_tokens=64)])
    assert rollout.metrics["multi_turn/interaction_turns"] == 2.0, sorted(rollout.metrics.items())
    assert rollout.metrics["multi_turn/interaction_turn_score/mean"] == 0.5
    rewards = RewardManager([(f"{__name__}:last_turn_score", 1.0)], num_workers=0)
    try:
        samples, _, _ = score_outputs(rewards, [(item, out)])
    finally:
        rewards.close()
    assert [s.reward for s in samples] == [1.0, 1.0]
    assert item.extra == {"extra_info": {"index": 3, "interaction_kwargs": KWARGS}}  # a copy


def last_turn_score(
    data_source: Any, solution_str: str, ground_truth: str, extra_info: Any
) -> float:
    """A verl reward function: the interaction's last turn score (verl's extra_info)."""
    assert extra_info["index"] == 3
    return float(extra_info["turn_scores"][-1])


class Faulty(BaseInteraction):
    """Fails in `where` ("start", "respond", "finalize") by `how` ("raise", "hang": blocks on
    `gate`, "shape": a 2-tuple); records the calls."""

    gate = threading.Event()

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.where, self.how = config["where"], config["how"]
        self.calls: list[str] = []

    def fail(self, here: str) -> Any:
        self.calls.append(here)
        if here != self.where:
            return None
        if self.how == "raise":
            raise RuntimeError(f"{here} broke")
        if self.how == "hang":
            Faulty.gate.wait(60)
        return "shape"

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        self.fail("start")
        return str(instance_id)

    async def generate_response(self, instance_id: str, messages: Any, **kwargs: Any) -> Any:
        if self.fail("respond") == "shape" and self.how == "shape":
            return (False, "two")
        return False, INCORRECT, 0.0, {}

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.fail("finalize")


@pytest.mark.parametrize(
    ("where", "how"),
    [
        ("respond", "raise"),
        ("respond", "hang"),
        ("respond", "shape"),
        ("start", "raise"),
        ("finalize", "hang"),
    ],
)
def test_an_interaction_that_raises_or_hangs_ends_its_sample_and_never_hangs(
    models: dict[str, Path], where: str, how: str
) -> None:
    Faulty.gate.clear()
    interaction = Faulty({"name": "gsm8k", "where": where, "how": how})
    try:
        out, rec, _, _ = run_one(
            models["stuck"], interaction, interaction_timeout_s=0.5, max_user_turns=1
        )
    finally:
        Faulty.gate.set()
    assert out.metrics["interaction_errors"] == 1
    assert out.metrics["interaction_timeouts"] == int(how == "hang")
    if where == "finalize":  # the sample had ended: its user turn is kept
        assert out.metrics["interaction_turns"] == 1 and len(rec.turns) == 2
        return
    assert len(rec.turns) == 1 and out.response_mask == [1] * len(out.response_ids)
    assert out.metrics["interaction_turns"] == 0
    # a started interaction is finalized; one whose start failed is not
    assert interaction.calls == (
        ["start"] if where == "start" else ["start", "respond", "finalize"]
    )


def test_a_cut_sample_finalizes_and_restarts_its_interaction_and_ends_as_uncut(
    models: dict[str, Path],
) -> None:
    want, _, _, _ = run_one(models["retry"], Recording({"name": "gsm8k"}))
    eng = engine(models["retry"])
    interaction = Recording({"name": "gsm8k"})
    loop = loop_of(eng, interaction)
    runner = AgentLoopRunner(eng, {"tool_agent": loop})
    row = {"raw_prompt": QUESTION, "interaction_kwargs": dict(KWARGS)}
    respond = interaction.generate_response

    async def stopping(instance_id: str, messages: Any, **kwargs: Any) -> Any:
        runner.server.stop()  # the quota is met while the user answers
        return await respond(instance_id, messages, **kwargs)

    interaction.generate_response = stopping  # type: ignore[method-assign]
    (st,) = runner.run_partial([row], GREEDY, groups=[0], quota=1)
    assert isinstance(st, TurnState) and st.open_turn is None
    assert st.response_mask[-1] == 0 and st.turn_scores == [0.0]
    assert [k for k, _ in interaction.calls] == ["start", "respond", "finalize"]
    interaction.generate_response = respond  # type: ignore[method-assign]
    (out,) = runner.run([{**row, "resume": st}], GREEDY)
    assert out.response_ids == want.response_ids and out.response_mask == want.response_mask
    assert out.extra_fields["turn_scores"] == [0.0, 1.0]
    assert [k for k, _ in interaction.calls][3:] == ["start", "respond", "finalize"]
    assert interaction.calls[3][1] == KWARGS  # started again with the row's kwargs


def test_verls_interaction_config_loads_and_bad_ones_are_named_with_their_key(
    tmp_path: Path,
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(GSM8K_INTERACTION_CONFIG)
    (found,) = load_interactions(good).values()
    assert isinstance(found, Gsm8kInteraction) and found.name == "gsm8k"
    unnamed = tmp_path / "unnamed.yaml"
    unnamed.write_text(yaml.safe_dump({"interaction": [{"class_name": PORT, "config": {}}]}))
    assert list(load_interactions(unnamed)) == ["gsm8k"]  # verl's name from the class
    cases = {
        "missing.yaml": None,
        "notyaml.yaml": "interaction: [",
        "nolist.yaml": "interaction: 3",
        "noimport.yaml": "interaction: [{name: a, class_name: nowhere.Thing}]",
        "notsub.yaml": "interaction: [{name: a, class_name: pathlib.Path}]",
        "twice.yaml": f"interaction: [{{name: a, class_name: {PORT}}}, {{name: a, class_name: {PORT}}}]",
    }
    said = {
        "missing.yaml": "no such file",
        "notyaml.yaml": "not valid YAML",
        "nolist.yaml": "`interaction` list",
        "noimport.yaml": "interaction.0.class_name='nowhere.Thing': cannot import",
        "notsub.yaml": "interaction.0.class_name='pathlib.Path' is not a subclass",
        "twice.yaml": "interaction.1.name='a'",
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(InteractionConfigError) as e:
            load_interactions(path)
        assert str(path) in str(e.value) and said[name] in str(e.value), str(e.value)
        config = load_config(
            None,
            [
                "rollout.multi_turn.enable=true",
                f"rollout.multi_turn.interaction_config_path={path}",
            ],
        )
        (problem,) = multi_turn_problems(config)
        assert problem.startswith("rollout.multi_turn.interaction_config_path: ")
        assert said[name] in problem


def test_preflight_names_a_row_without_a_name_or_with_an_unknown_one_and_async_runs(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    from patrl.orchestrator.main import main

    config = tmp_path / "interaction.yaml"
    config.write_text(GSM8K_INTERACTION_CONFIG)
    rows = [
        {
            "prompt": QUESTION,
            "reward_model": {"ground_truth": "42"},
            "extra_info": {"interaction_kwargs": kwargs},
        }
        for kwargs in (KWARGS, {"ground_truth": "42"}, {**KWARGS, "name": "chess"})
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        f"model.path={models['retry']}",
        f"data.train_files={data}",
        "data.train_batch_size=1",
        "actor.ppo_mini_batch_size=1",
        "rollout.adaptive_tp.enable=false",
        "rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={config}",
    ]
    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["--dry-run", *args]) != 0
    text = err.getvalue()
    assert "data.train_files: row 1: extra_info.interaction_kwargs has no `name`" in text
    assert "row 2: extra_info.interaction_kwargs.name='chess' is not a configured" in text
    job = load_config(None, [*args[1:], "trainer.mode=async"])
    assert unsupported(job, 2) == []  # the async schedule runs (and migrates) interactions


# volcengine/verl: examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_w_interaction.sh,
# its python3 command verbatim but for the model ($MODEL) and the shell arithmetic
# $((1024 * 3)), written out
VERL_GSM8K_W_INTERACTION = r"""
python3 -m verl.trainer.main_ppo \
    --config-path="$CONFIG_PATH" \
    --config-name='gsm8k_multiturn_grpo' \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=$TRAIN_BATCH_SIZE \
    data.max_prompt_length=1024 \
    data.max_response_length=3072 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path=$MODEL \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    +actor_rollout_ref.model.enable_activation_offloading=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=$TRAIN_BATCH_SIZE \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$MICRO_BATCH_SIZE \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.fsdp_config.param_offload=$OFFLOAD \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=$OFFLOAD \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$MICRO_BATCH_SIZE \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=$MICRO_BATCH_SIZE \
    actor_rollout_ref.ref.fsdp_config.param_offload=$OFFLOAD \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger=['console','wandb'] \
    trainer.project_name='gsm8k_async_rl' \
    trainer.experiment_name='qwen2.5-3b_function_rm-gsm8k-sgl-multi-w-interaction-n8' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=20 \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    actor_rollout_ref.rollout.multi_turn.interaction_config_path="$PROJECT_DIR/examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml" \
    trainer.total_epochs=15 $@
"""


def test_verls_gsm8k_interaction_command_line_dry_runs_to_the_same_values(
    verl_project: dict[str, str],  # noqa: F811 (the imported fixture)
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """verl's script with the environment it reads set as a user sets it (OFFLOAD=False:
    patrl keeps parameters on the device; a batch the 260 rows hold), over verl's layout
    (test_orchestrator_verl_gsm8k_tool's) with the interaction config added and rows as
    verl's gsm8k_w_interaction.py writes them (interaction_kwargs named "gsm8k")."""
    import datasets
    from test_orchestrator_verl_gsm8k_tool import PATRL_EXTRA, gsm8k_rows

    from patrl.orchestrator.main import main

    config = (
        Path(verl_project["CONFIG_PATH"]) / "interaction_config" / "gsm8k_interaction_config.yaml"
    )
    config.parent.mkdir()
    config.write_text(GSM8K_INTERACTION_CONFIG)
    data = Path(verl_project["HOME"]) / "data" / "gsm8k"
    for split, count in (("train", 260), ("test", 4)):
        rows = gsm8k_rows(split, count)
        for r in rows:
            r["extra_info"]["interaction_kwargs"]["name"] = "gsm8k"
        datasets.Dataset.from_list(rows).to_parquet(str(data / f"{split}.parquet"))
    # the line's 1024 + 3072 tokens need a model that long
    model = save_scripted_model(
        data.parent / "model4k",
        tokenizer(),
        None,
        RIGHT,
        first_answer=WRONG,
        max_position_embeddings=4096,
    )
    env = {
        **verl_project,
        "MODEL": str(model),
        "TRAIN_BATCH_SIZE": "256",
        "MICRO_BATCH_SIZE": "16",
        "OFFLOAD": "False",
    }
    text = VERL_GSM8K_W_INTERACTION.replace("$@", " ".join(PATRL_EXTRA))
    for name in sorted(env, key=len, reverse=True):
        text = text.replace(f"${name}", env[name])
    words = shlex.split(text.replace("\\\n", " "))
    assert words[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert main(["--dry-run", *words[3:]]) == 0
    out = capsys.readouterr()
    c = yaml.safe_load(out.out)
    expected = {
        "data.train_batch_size": 256,
        "data.max_response_length": 3072,
        "actor.ppo_mini_batch_size": 256,
        "actor.ppo_micro_batch_size_per_gpu": 16,
        "rollout.tensor_model_parallel_size": 2,
        "rollout.n": 8,
        "rollout.multi_turn.enable": True,  # the Hydra config's
        "rollout.multi_turn.max_assistant_turns": 5,
        "rollout.multi_turn.tool_config_path": None,
        "rollout.multi_turn.interaction_config_path": str(config),
        "rollout.multi_turn.max_user_turns": None,
        "trainer.project_name": "gsm8k_async_rl",
        "trainer.total_epochs": 15,
    }
    for key, value in expected.items():
        node: Any = c
        for part in key.split("."):
            node = node[part]
        assert node == value, f"{key}: {node!r} != {value!r}"
    assert "unknown key" not in out.err


@pytest.mark.e2e
def test_a_job_with_an_interaction_runs_two_steps(tmp_path: Path, models: dict[str, Path]) -> None:
    from patrl.orchestrator.main import main

    config = tmp_path / "interaction.yaml"
    config.write_text(GSM8K_INTERACTION_CONFIG)
    data = tmp_path / "train.jsonl"
    rows = [
        {
            "prompt": QUESTION,
            "reward_model": {"ground_truth": "42"},
            "extra_info": {"index": i, "interaction_kwargs": KWARGS},
        }
        for i in range(2)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    overrides: dict[str, Any] = {
        "model.path": models["retry"],
        "data.train_files": data,
        "data.train_batch_size": 2,
        "data.max_response_length": 256,
        "actor.ppo_mini_batch_size": 2,
        "rollout.n": 2,
        "rollout.temperature": 0.05,
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 512,
        "rollout.adaptive_tp.enable": "false",
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.interaction_config_path": config,
        "rollout.multi_turn.max_user_turns": 2,
        "reward.functions": f'[{{name: "{__name__}:last_turn_score_or_zero"}}]',
        "reward.num_workers": 0,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 0,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": run,
    }
    assert main([f"{k}={v}" for k, v in overrides.items()]) == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "actor/pg_loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["multi_turn/interaction_turns"] > 0
        assert 0.0 <= r["multi_turn/interaction_turn_score/mean"] <= 1.0
        assert r["response_length/model_tokens/mean"] < r["response_length/mean"]


def last_turn_score_or_zero(
    data_source: Any, solution_str: str, ground_truth: str, extra_info: Any
) -> float:
    scores = (extra_info or {}).get("turn_scores") or [0.0]
    return float(scores[-1])


# ------------------------------------------------------------------ adaptive TP


def interaction_job(path: Path) -> Any:
    return load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            "data.max_response_length=256",
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.interaction_config_path={path}",
        ],
    )


def rank_items(rank: int) -> tuple[list[PromptItem], list[SamplingParams]]:
    extra = {"extra_info": {"interaction_kwargs": dict(KWARGS)}}
    item = PromptItem(10 * rank, [], "What is 6*7?", "42", extra, QUESTION)
    return [item], [SamplingParams(n=2, temperature=0.0, max_tokens=64, seed=3 + rank)]


def as_lists(outs: list[Any]) -> dict[str, Any]:
    return {
        "tokens": [[c.token_ids for c in o.outputs] for o in outs],
        "masks": [[c.response_mask for c in o.outputs] for o in outs],
        "scores": [[c.turn_scores for c in o.outputs] for o in outs],
    }


def _adaptive(rank: int, world_size: int, model_dir: str, config: str) -> dict[str, Any]:
    from test_orchestrator_agent_adaptive import GatedFoldPlanner

    from patrl.lenpredict import LengthPredictor
    from patrl.orchestrator.agent.adaptive_agent_loop import AdaptiveMultiTurnRollout
    from patrl.rollout.adaptive import AdaptiveEngine
    from patrl.tpreshard import GroupCache

    policy = {
        "kind": "adaptive",
        "candidates": (1, 2),
        "check_every": 2,
        "check_budget": 0.0,
        "kv_policy": "auto",
    }
    planner = GatedFoldPlanner(waiting=0)  # folds at its first check with turns running
    engine = AdaptiveEngine(
        EngineConfig(
            model=model_dir,
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=512,
            max_model_len=1024,
            tp_policy=policy,
        ),
        groups=GroupCache([1, 2], world_size=world_size, rank=rank),
        planner=planner,
        lengths=LengthPredictor(),
    )
    rollout = AdaptiveMultiTurnRollout(interaction_job(Path(config)), engine)
    items, params = rank_items(rank)
    out = as_lists(rollout.generate(items, params))
    return {
        **out,
        "metrics": dict(rollout.metrics),
        "switches": engine.stats()["tp_switches"],
    }


@pytest.mark.multirank
def test_interactions_under_adaptive_tp_with_a_fold_change_no_token(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """World rank 0 runs every rank's interactions; a fold mid-rollout changes no token:
    each rank's trajectories and turn scores equal its static TP 1 run's."""
    from patrl_testkit.multirank import run_ranks

    config = tmp_path / "interaction.yaml"
    config.write_text(GSM8K_INTERACTION_CONFIG)
    twins = []
    for rank in range(2):
        twin = MultiTurnRollout(interaction_job(config), engine(models["retry"]))
        twins.append(as_lists(twin.generate(*rank_items(rank))))
    results = run_ranks(
        _adaptive, world_size=2, args=(str(models["retry"]), str(config)), timeout_s=300
    )
    for got, want in zip(results, twins, strict=True):
        assert got["switches"] >= 1  # the rollout folded to TP 2
        assert got["tokens"] == want["tokens"] and got["masks"] == want["masks"]
        assert got["scores"] == want["scores"] == [[[0.0, 1.0], [0.0, 1.0]]]
        assert got["metrics"]["multi_turn/interaction_turns"] == 2.0
        # the failure guard's counters: 2 samples x 2 answers asked, none failed
        assert got["metrics"]["multi_turn/interaction/gsm8k/calls"] == 4.0
        assert got["metrics"]["multi_turn/interaction/gsm8k/failures"] == 0.0


class CountingGsm8k(Gsm8kInteraction):
    """The GSM8K port, counting its generate_response calls in this process."""

    responses = 0

    async def generate_response(self, instance_id: str, messages: Any, **kwargs: Any) -> Any:
        CountingGsm8k.responses += 1
        return await super().generate_response(instance_id, messages, **kwargs)


def _static_tp2(rank: int, world_size: int, model_dir: str, config: str) -> dict[str, Any]:
    import torch.distributed as dist

    from patrl.tpreshard import ParallelLayout

    group = dist.new_group(list(range(world_size)))
    layout = ParallelLayout(tp_size=world_size, tp_rank=rank, tp_group=group)
    eng = Engine(
        EngineConfig(
            model=model_dir, dtype="float32", block_size=4, num_kv_blocks=512, max_model_len=1024
        ),
        layout,
    )
    rollout = MultiTurnRollout(interaction_job(Path(config)), eng)
    out = as_lists(rollout.generate(*rank_items(0)))
    return {**out, "metrics": dict(rollout.metrics), "responses": CountingGsm8k.responses}


@pytest.mark.multirank
def test_interactions_at_static_tp2_run_once_on_the_first_rank_as_tp1_runs_them(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    from patrl_testkit.multirank import run_ranks

    config = tmp_path / "interaction.yaml"
    config.write_text(GSM8K_INTERACTION_CONFIG.replace(PORT, f"{__name__}.CountingGsm8k"))
    want = as_lists(
        MultiTurnRollout(interaction_job(config), engine(models["retry"])).generate(*rank_items(0))
    )
    ranks = run_ranks(
        _static_tp2, world_size=2, args=(str(models["retry"]), str(config)), timeout_s=300
    )
    for got in ranks:  # the peer's outputs are the first rank's, broadcast
        assert got["tokens"] == want["tokens"] and got["masks"] == want["masks"]
        assert got["scores"] == want["scores"] == [[[0.0, 1.0], [0.0, 1.0]]]
    assert ranks[0]["metrics"]["multi_turn/interaction_turns"] == 2.0
    assert [r["responses"] for r in ranks] == [4, 0]  # 2 samples x 2 answers, on rank 0 only
