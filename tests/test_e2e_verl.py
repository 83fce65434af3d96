"""A verl user's job in patrl: verl's own GSM8K GRPO command line passes `--dry-run` and
resolves to the same values, and the run loop keeps verl's meanings (validation after the last
step, every validation prompt validated in batches of data.val_batch_size, checkpoints in
trainer.default_local_dir)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_e2e_grpo import make_loop

from patrl.orchestrator import run_checkpoint
from patrl.orchestrator.distributed import World
from patrl.orchestrator.main import main
from patrl_testkit.models import save_tiny_model

# verl's examples/grpo_trainer/run_qwen2-7b.sh (volcengine/verl, commit b178a3c), verbatim but
# for the data and model paths ($DATA, $MODEL) and the trailing $@.
VERL_GSM8K_GRPO = r"""
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$DATA/gsm8k/train.parquet \
    data.val_files=$DATA/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=$MODEL \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15
"""
NUM_TRAIN, NUM_TEST = 2100, 40  # 2 batches of 1024 per epoch (verl drops the last partial one)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _gsm8k_rows(split: str, count: int) -> list[dict[str, Any]]:
    """Rows laid out as verl's examples/data_preprocess/gsm8k.py writes them."""
    rows = []
    for idx in range(count):
        a, b = idx % 50, idx % 7 + 1
        question = f"Tom has {a} marbles and finds {b} more. How many marbles does he have?"
        answer = f"He has {a} + {b} = {a + b} marbles.\n#### {a + b}"
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {
                    "split": split,
                    "index": idx,
                    "answer": answer,
                    "question": question,
                },
            }
        )
    return rows


def _verl_args(data: Path, model: Path) -> list[str]:
    """The command line's arguments as the shell hands them to verl's main_ppo."""
    text = VERL_GSM8K_GRPO.replace("$DATA", str(data)).replace("$MODEL", str(model))
    words = shlex.split(text.replace("\\\n", " "))  # a backslash-newline continues the line
    assert words[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    return words[3:]


def test_verls_gsm8k_grpo_command_line_dry_runs_to_the_same_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import datasets

    from patrl_examples.demo.tokenizer import build_tokenizer

    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)
    for split, count in (("train", NUM_TRAIN), ("test", NUM_TEST)):
        rows = _gsm8k_rows(split, count)
        datasets.Dataset.from_list(rows).to_parquet(str(data / "gsm8k" / f"{split}.parquet"))
    tok = build_tokenizer()  # it has a chat template: verl's prompts are chat messages
    model = save_tiny_model(
        tmp_path / "model", "llama", "plain", tokenizer=tok, max_position_embeddings=2048
    )
    # verl's trainer.n_gpus_per_node=8 trainer.nnodes=1: the world torchrun would start
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.chdir(tmp_path)  # the default run dir (resume_mode=auto looks there) is empty
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as where it is missing

    assert main(["--dry-run", *_verl_args(data, model)]) == 0
    out = capsys.readouterr()
    c = yaml.safe_load(out.out)

    train, test = str(data / "gsm8k" / "train.parquet"), str(data / "gsm8k" / "test.parquet")
    steps = 15 * (NUM_TRAIN // 1024)  # total_epochs x batches per epoch
    expected = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,
        "data.train_files": train,
        "data.val_files": test,
        "data.train_batch_size": 1024,
        "data.max_prompt_length": 512,
        "data.max_response_length": 1024,
        "data.filter_overlong_prompts": True,
        "data.truncation": "error",
        "model.path": str(model),
        "actor.optim.lr": 1e-6,
        "actor.optim.total_training_steps": steps,  # verl hands the optimizer the run's length
        "actor.optim.lr_scheduler_type": "constant",
        "actor.use_remove_padding": True,
        "actor.ppo_mini_batch_size": 256,
        "actor.ppo_micro_batch_size_per_gpu": 40,
        "actor.use_dynamic_bsz": False,
        "actor.use_kl_loss": True,
        "actor.kl_loss_coef": 0.001,
        "actor.kl_loss_type": "low_var_kl",
        "actor.entropy_coeff": 0,
        "actor.enable_gradient_checkpointing": True,
        "actor.clip_ratio": 0.2,  # verl's defaults where the line sets nothing
        "actor.ppo_epochs": 1,
        "actor.loss_agg_mode": "token-mean",
        "actor.grad_clip": 1.0,
        "rollout.tensor_model_parallel_size": 2,
        "rollout.gpu_memory_utilization": 0.6,
        "rollout.n": 5,
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "rollout.top_k": -1,
        "rollout.val_kwargs.temperature": 0.0,
        "trainer.critic_warmup": 0,
        "trainer.logger": ["console", "wandb"],
        "trainer.project_name": "verl_grpo_example_gsm8k",
        "trainer.experiment_name": "qwen2_7b_function_rm",
        "trainer.n_gpus_per_node": 8,
        "trainer.nnodes": 1,
        "trainer.save_freq": 20,
        "trainer.test_freq": 5,
        "trainer.val_before_train": True,
        "trainer.total_epochs": 15,
        "trainer.total_training_steps": steps,
        "trainer.resume_mode": "auto",
    }
    for key, value in expected.items():
        node: Any = c
        for part in key.split("."):
            node = node[part]
        assert node == value, f"{key}: {node!r} != {value!r}"

    notes = [line for line in out.err.splitlines() if line.startswith("patrl: note: ")]
    said = "\n".join(notes)
    for key in (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.rollout.name='vllm'",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    ):
        assert f"verl's {key} has no effect in patrl: " in said, key
    assert "wandb is not installed (pip install wandb)" in said
    assert "rollout.tensor_model_parallel_size=2 is the static layout" in said
    assert len(notes) == 6  # the offloads at False ask for what patrl does: no note
    assert "unknown key" not in out.err


def test_the_command_line_fails_naming_both_when_the_world_is_not_8_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    args = _verl_args(data, tmp_path / "model")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)
    assert main(["--dry-run", *args]) == 2
    err = capsys.readouterr().err
    assert "trainer.n_gpus_per_node=8 do not match the world torchrun started" in err
    assert "WORLD_SIZE=2 with LOCAL_WORLD_SIZE=2" in err


@pytest.mark.e2e
def test_validation_after_the_last_step_covers_every_prompt_in_batches(
    assets: Path, tmp_path: Path
) -> None:
    """test_freq=2 over 3 steps validates after step 2 and after the last step (verl's rule);
    data.val_batch_size=3 of 4 prompts generates 3 then 1, and all 4 are scored, each
    `rollout.val_kwargs.n`=2 times (verl's mean@2 / best@2 metrics); checkpoints land in
    trainer.default_local_dir itself."""
    world = World(0, 1, 0, torch.device("cpu"))
    extra = {
        "trainer.total_training_steps": 3,
        "trainer.test_freq": 2,
        "trainer.val_before_train": "false",
        "data.val_batch_size": 3,
        "rollout.val_kwargs.n": 2,
        "rollout.val_kwargs.temperature": 1.0,
        "trainer.rollout_data_dir": tmp_path / "rollouts",
        "trainer.validation_data_dir": tmp_path / "validations",
    }
    loop = make_loop(assets, tmp_path, world, **extra)
    calls: list[tuple[int, list[int]]] = []
    generate = loop._generate

    def recording(items: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("split") == "validation":
            calls.append((loop.step, [item.index for item in items]))
        return generate(items, *args, **kwargs)

    loop._generate = recording  # type: ignore[method-assign]
    history = loop.run().history
    assert calls == [(2, [0, 1, 2]), (2, [3]), (3, [0, 1, 2]), (3, [3])]
    validated = [h for h in history if "val-core/acc/mean@1" in h]
    assert [h["step"] for h in validated] == [2.0, 3.0]
    for h in validated:  # the rows have no data_source: verl's "unknown"; 2 responses a prompt
        # every prompt has 2 responses, so the mean of the prompts' means is the mean of all
        assert h["val-core/unknown/reward/mean@2"] == pytest.approx(h["val-core/acc/mean@1"])
        assert h["val-core/unknown/reward/best@2/mean"] >= h["val-core/unknown/reward/mean@2"]
        assert h["val-aux/unknown/reward/worst@2/mean"] <= h["val-core/unknown/reward/mean@2"]
        assert "val-aux/unknown/reward/std@2" in h
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val-core/acc/mean@1" in r] == [2.0, 3.0]
    assert run_checkpoint.latest_checkpoint(tmp_path) == tmp_path / "global_step_3"
    # verl's dumps: every step's responses, and every validation's (4 prompts x 2 responses)
    steps = {int(p.stem): p for p in (tmp_path / "rollouts").glob("*.jsonl")}
    assert sorted(steps) == [1, 2, 3]
    config = loop.config
    for step, path in steps.items():
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert len(lines) == config.data.train_batch_size * config.rollout.n
        assert {r["step"] for r in lines} == {step}
        assert set(lines[0]) >= {"input", "output", "gts", "score", "step"}
    scores = [
        r["score"] for p in steps.values() for r in map(json.loads, p.read_text().splitlines())
    ]
    assert all(isinstance(x, float) for x in scores)
    validations = {int(p.stem): p for p in (tmp_path / "validations").glob("*.jsonl")}
    assert sorted(validations) == [2, 3]
    for step, path in validations.items():
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert len(lines) == 4 * 2
        mean = sum(r["score"] for r in lines) / len(lines)
        (row,) = [h for h in validated if h["step"] == step]
        assert mean == pytest.approx(row["val-core/acc/mean@1"])  # the very responses scored
    assert not list((tmp_path / "rollouts").glob(".*.tmp"))  # nothing half-written left


@pytest.mark.e2e
def test_val_only_validates_the_starting_weights_and_trains_no_step(
    assets: Path, tmp_path: Path
) -> None:
    """verl's `trainer.val_only`: validation before training, then the run ends: no step, no
    checkpoint, one validation row at step 0."""
    world = World(0, 1, 0, torch.device("cpu"))
    extra = {"trainer.total_training_steps": 3, "trainer.val_only": "true"}
    loop = make_loop(assets, tmp_path, world, **extra)
    result = loop.run()
    assert result.steps == 0 and loop.step == 0
    assert [h["step"] for h in result.history] == [0.0]
    assert "val-core/acc/mean@1" in result.history[0]
    assert "actor/pg_loss" not in result.history[0]
    assert run_checkpoint.latest_checkpoint(tmp_path) is None
