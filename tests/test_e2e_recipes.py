"""verl's recipes in a real (tiny) job: truncated IS engages when the engine's logprobs are
off, and verl's DAPO command line resolves to the same values."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl_testkit.jobs import tiny_job_overrides

SHIFT = 1.0  # subtracted from every engine logprob of the perturbed step

# verl's recipe/dapo/test_dapo_7b.sh (volcengine/verl 246cac4, the last commit before recipe/
# moved to verl-recipe), verbatim.
VERL_DAPO = r"""
#!/usr/bin/env bash
set -xeuo pipefail

project_name='DAPO'
exp_name='DAPO-Qwen2.5-7B-Math-Test'

adv_estimator=grpo

use_kl_in_reward=False
kl_coef=0.0
use_kl_loss=False
kl_loss_coef=0.0

clip_ratio_low=0.2
clip_ratio_high=0.28

max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 2))
enable_overlong_buffer=True
overlong_buffer_len=512
overlong_penalty_factor=1.0

loss_agg_mode="token-mean"

enable_filter_groups=True
filter_groups_metric=acc
max_num_gen_batches=10
train_prompt_bsz=512
gen_prompt_bsz=$((train_prompt_bsz * 3))
train_prompt_mini_bsz=32
n_resp_per_prompt=16

# Ray
RAY_ADDRESS=${RAY_ADDRESS:-"http://localhost:8265"}
WORKING_DIR=${WORKING_DIR:-"${PWD}"}
RUNTIME_ENV=${RUNTIME_ENV:-"${WORKING_DIR}/verl/trainer/runtime_env.yaml"}
NNODES=${NNODES:-4}
# Paths
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}/verl"}
MODEL_PATH=${MODEL_PATH:-"${RAY_DATA_HOME}/models/Qwen2.5-Math-7B"}
CKPTS_DIR=${CKPTS_DIR:-"${RAY_DATA_HOME}/ckpts/${project_name}/${exp_name}"}
TRAIN_FILE=${TRAIN_FILE:-"${RAY_DATA_HOME}/data/dapo-math-17k.parquet"}
TEST_FILE=${TEST_FILE:-"${RAY_DATA_HOME}/data/aime-2024.parquet"}

# Algorithm
temperature=1.0
top_p=1.0
top_k=-1 # 0 for HF rollout, -1 for vLLM rollout

# Mathematically equivalent
use_dynamic_bsz=True
infer_micro_batch_size=null
train_micro_batch_size=null
offload=False

ray job submit --no-wait --runtime-env="${RUNTIME_ENV}" \
    --working-dir "${WORKING_DIR}" \
    -- python3 -m recipe.dapo.main_dapo \
    data.train_files="${TRAIN_FILE}" \
    data.val_files="${TEST_FILE}" \
    data.prompt_key=prompt \
    data.truncation='left' \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    data.gen_batch_size=${gen_prompt_bsz} \
    data.train_batch_size=${train_prompt_bsz} \
    actor_rollout_ref.rollout.n=${n_resp_per_prompt} \
    actor_rollout_ref.actor.use_kl_loss=${use_kl_loss} \
    actor_rollout_ref.actor.kl_loss_coef=${kl_loss_coef} \
    actor_rollout_ref.actor.clip_ratio_low=${clip_ratio_low} \
    actor_rollout_ref.actor.clip_ratio_high=${clip_ratio_high} \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    algorithm.adv_estimator=${adv_estimator} \
    algorithm.use_kl_in_reward=${use_kl_in_reward} \
    algorithm.kl_ctrl.kl_coef=${kl_coef} \
    algorithm.filter_groups.enable=${enable_filter_groups} \
    algorithm.filter_groups.metric=${filter_groups_metric} \
    algorithm.filter_groups.max_num_gen_batches=${max_num_gen_batches} \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.use_dynamic_bsz=${use_dynamic_bsz} \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=${use_dynamic_bsz} \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=${use_dynamic_bsz} \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((max_prompt_length + max_response_length)) \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$((max_prompt_length + max_response_length)) \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$((max_prompt_length + max_response_length)) \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${train_prompt_mini_bsz} \
    actor_rollout_ref.actor.ppo_micro_batch_size=${train_micro_batch_size} \
    actor_rollout_ref.actor.fsdp_config.param_offload=${offload} \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=${offload} \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.actor.loss_agg_mode=${loss_agg_mode} \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.85 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=${infer_micro_batch_size} \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.enable_chunked_prefill=True \
    actor_rollout_ref.rollout.max_num_batched_tokens=$((max_prompt_length + max_response_length)) \
    actor_rollout_ref.rollout.temperature=${temperature} \
    actor_rollout_ref.rollout.top_p=${top_p} \
    actor_rollout_ref.rollout.top_k="${top_k}" \
    actor_rollout_ref.rollout.val_kwargs.temperature=${temperature} \
    actor_rollout_ref.rollout.val_kwargs.top_p=${top_p} \
    actor_rollout_ref.rollout.val_kwargs.top_k=${top_k} \
    actor_rollout_ref.rollout.val_kwargs.do_sample=True \
    actor_rollout_ref.rollout.val_kwargs.n=1 \
    actor_rollout_ref.ref.log_prob_micro_batch_size=${infer_micro_batch_size} \
    actor_rollout_ref.ref.fsdp_config.param_offload=${offload} \
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=1 \
    actor_rollout_ref.actor.fsdp_config.fsdp_size=-1 \
    reward_model.reward_manager=dapo \
    reward_model.overlong_buffer.enable=${enable_overlong_buffer} \
    reward_model.overlong_buffer.len=${overlong_buffer_len} \
    reward_model.overlong_buffer.penalty_factor=${overlong_penalty_factor} \
    trainer.logger='["console","wandb"]' \
    trainer.project_name="${project_name}" \
    trainer.experiment_name="${exp_name}" \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes="${NNODES}" \
    trainer.val_before_train=True \
    trainer.test_freq=2 \
    trainer.save_freq=2 \
    trainer.total_epochs=1 \
    trainer.default_local_dir="${CKPTS_DIR}" \
    trainer.resume_mode=disable
"""
# Its launcher, `ray job submit ... -- python3 -m recipe.dapo.main_dapo`, is swapped for a
# printer of the arguments; bash expands the script's own variables.
LAUNCHER = (
    'ray job submit --no-wait --runtime-env="${RUNTIME_ENV}" \\\n'
    '    --working-dir "${WORKING_DIR}" \\\n'
    "    -- python3 -m recipe.dapo.main_dapo \\\n"
)


def _run(assets: Path, run_dir: Path, steps: int, **extra: Any) -> list[dict[str, float]]:
    """A tiny job whose first training rollout's engine logprobs are lowered by SHIFT (a
    wrapper around the loop's generation: the engine itself is untouched)."""
    extra = {
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
        "trainer.total_training_steps": steps,
        "trainer.save_freq": -1,
        **extra,
    }
    config = load_config(None, tiny_job_overrides(assets, run_dir, **extra))
    loop = SyncGRPO(
        config,
        World(0, 1, 0, torch.device("cpu")),
        str(assets / "model"),
        config.data.train_files,
        None,
    )
    generate = loop._generate
    calls: list[int] = []

    def perturbed(items: Any, *args: Any, **kwargs: Any) -> Any:
        out = generate(items, *args, **kwargs)
        if kwargs.get("split", "train") != "train":
            return out
        calls.append(loop.step)
        if len(calls) == 1:  # the first step's rollout only
            for _, request in out:
                for completion in request.outputs:
                    completion.logprobs = [lp - SHIFT for lp in completion.logprobs]
        return out

    loop._generate = perturbed  # type: ignore[method-assign]
    return [h for h in loop.run().history if "critic/score/mean" in h]


@pytest.mark.e2e
def test_tis_engages_when_the_engine_logprobs_are_perturbed(assets: Path, tmp_path: Path) -> None:
    """Token TIS at threshold 2. Step 1's engine logprobs are lowered by 1.0 on purpose, so
    pi_train / pi_rollout = e > 2 on every token: the KL metric reads -1, the weights' mean e
    (verl's metric is taken before truncation), and every weight is truncated to 2, so the
    policy gradient is exactly twice that of the same step without correction (same seed,
    same samples, same old logprobs): grad_norm (before clipping) doubles. Step 2 is
    unperturbed: KL ~ 0, weights ~ 1."""
    tis = {
        "algorithm.rollout_correction.rollout_is": "token",
        "algorithm.rollout_correction.rollout_is_threshold": 2.0,
    }
    first, second = _run(assets, tmp_path / "tis", 2, **tis)
    (plain,) = _run(assets, tmp_path / "plain", 1)
    assert first["critic/score/mean"] == plain["critic/score/mean"]  # the same samples
    assert first["rollout_corr/kl"] == pytest.approx(-SHIFT, abs=1e-3)
    assert plain["rollout_corr/kl"] == pytest.approx(-SHIFT, abs=1e-3)  # measured, uncorrected
    assert "rollout_corr/rollout_is_mean" not in plain
    assert first["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0
    assert first["rollout_corr/rollout_is_mean"] == pytest.approx(math.e, rel=1e-3)
    assert plain["actor/grad_norm"] > 0
    assert first["actor/grad_norm"] == pytest.approx(2.0 * plain["actor/grad_norm"], rel=1e-4)
    assert abs(second["rollout_corr/kl"]) < 1e-3
    assert second["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)


def _dapo_args(**paths: Path) -> list[str]:
    """The script's arguments as bash hands them to main_dapo: its launcher swapped for a
    printer, MODEL_PATH / TRAIN_FILE / TEST_FILE / CKPTS_DIR from `paths`."""
    assert LAUNCHER in VERL_DAPO
    text = VERL_DAPO.replace(LAUNCHER, "printf '%s\\n' \\\n")
    env = {**os.environ, **{k: str(v) for k, v in paths.items()}}
    done = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def _dapo_rows(count: int) -> list[dict[str, Any]]:
    """Rows laid out as verl's DAPO-Math-17k parquet has them."""
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": f"What is {i} + {i % 7}?"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(i + i % 7), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": str(i)},
        }
        for i in range(count)
    ]


NUM_DAPO_TRAIN = 3100  # 2 batches of gen_batch_size 1536 in the one epoch


def test_verls_dapo_command_line_dry_runs_to_the_same_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import datasets
    import yaml

    from patrl.orchestrator.main import main
    from patrl_examples.demo.tokenizer import build_tokenizer
    from patrl_testkit.models import save_tiny_model

    train, test = tmp_path / "dapo-math-17k.parquet", tmp_path / "aime-2024.parquet"
    datasets.Dataset.from_list(_dapo_rows(NUM_DAPO_TRAIN)).to_parquet(str(train))
    datasets.Dataset.from_list(_dapo_rows(30)).to_parquet(str(test))
    model = save_tiny_model(
        tmp_path / "model",
        "llama",
        "plain",
        tokenizer=build_tokenizer(),
        max_position_embeddings=4096,
    )
    ckpts = tmp_path / "ckpts"
    args = _dapo_args(MODEL_PATH=model, TRAIN_FILE=train, TEST_FILE=test, CKPTS_DIR=ckpts)
    monkeypatch.setenv("WORLD_SIZE", "32")  # trainer.n_gpus_per_node=8 x trainer.nnodes=4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)
    assert main(["--dry-run", *args]) == 0
    out = capsys.readouterr()
    c = yaml.safe_load(out.out)
    expected = {
        "data.train_files": str(train),
        "data.val_files": str(test),
        "data.prompt_key": "prompt",
        "data.truncation": "left",
        "data.max_prompt_length": 2048,
        "data.max_response_length": 2048,
        "data.gen_batch_size": 1536,
        "data.train_batch_size": 512,
        "rollout.n": 16,
        "actor.use_kl_loss": False,
        "actor.kl_loss_coef": 0.0,
        "actor.clip_ratio_low": 0.2,
        "actor.clip_ratio_high": 0.28,
        "actor.clip_ratio_c": 10.0,
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,
        "algorithm.kl_ctrl.kl_coef": 0.0,
        "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "acc",
        "algorithm.filter_groups.max_num_gen_batches": 10,
        "actor.use_remove_padding": True,
        "actor.use_dynamic_bsz": True,
        "actor.ppo_max_token_len_per_gpu": 4096,
        "model.path": str(model),
        "actor.enable_gradient_checkpointing": True,
        "actor.optim.lr": 1e-6,
        "actor.optim.lr_warmup_steps": 10,
        "actor.optim.weight_decay": 0.1,
        "actor.ppo_mini_batch_size": 32,
        "actor.entropy_coeff": 0,
        "actor.grad_clip": 1.0,
        "actor.loss_agg_mode": "token-mean",
        "rollout.gpu_memory_utilization": 0.85,
        "rollout.tensor_model_parallel_size": 1,
        "rollout.max_num_batched_tokens": 4096,
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "rollout.top_k": -1,
        "rollout.val_kwargs.temperature": 1.0,
        "rollout.val_kwargs.top_p": 1.0,
        "rollout.val_kwargs.top_k": -1,
        "rollout.val_kwargs.n": 1,
        "reward_model.overlong_buffer.enable": True,
        "reward_model.overlong_buffer.len": 512,
        "reward_model.overlong_buffer.penalty_factor": 1.0,
        "reward_model.overlong_buffer.log": False,
        "trainer.logger": ["console", "wandb"],
        "trainer.project_name": "DAPO",
        "trainer.experiment_name": "DAPO-Qwen2.5-7B-Math-Test",
        "trainer.n_gpus_per_node": 8,
        "trainer.nnodes": 4,
        "trainer.val_before_train": True,
        "trainer.test_freq": 2,
        "trainer.save_freq": 2,
        "trainer.total_epochs": 1,
        "trainer.total_training_steps": NUM_DAPO_TRAIN // 1536,  # verl: batches of gen_batch_size
        "trainer.default_local_dir": str(ckpts),
        "trainer.resume_mode": "disable",
    }
    for key, value in expected.items():
        node: Any = c
        for part in key.split("."):
            node = node[part]
        assert node == value, f"{key}: {node!r} != {value!r}"
    assert "unknown key" not in out.err


@pytest.mark.e2e
def test_dapo_runs_two_steps_with_overlong_shaping_and_dynamic_sampling(
    assets: Path, tmp_path: Path
) -> None:
    """The DAPO recipe's pieces on the tiny job: 8 prompts drawn per round for 4 trained,
    groups filtered on the score before the penalty (metric acc), and every training sample's
    reward carrying verl's overlong penalty (8-token budget, 4-token buffer, factor 1)."""
    extra = {
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
        "trainer.total_training_steps": 2,
        "trainer.save_freq": -1,
        "data.gen_batch_size": 8,
        "algorithm.filter_groups.enable": "true",
        "algorithm.filter_groups.metric": "acc",
        "reward_model.reward_manager": "dapo",
        "reward_model.overlong_buffer.enable": "true",
        "reward_model.overlong_buffer.len": 4,
        "reward_model.overlong_buffer.penalty_factor": 1.0,
        "reward_model.overlong_buffer.log": "true",
    }
    config = load_config(None, tiny_job_overrides(assets, tmp_path, **extra))
    loop = SyncGRPO(
        config,
        World(0, 1, 0, torch.device("cpu")),
        str(assets / "model"),
        config.data.train_files,
        None,
    )
    score = loop._score
    scored: list[Any] = []
    drawn: list[int] = []

    def recording(local: Any, *args: Any, **kwargs: Any) -> Any:
        drawn.append(len(local))
        samples, shares = score(local, *args, **kwargs)
        scored.extend(samples)
        return samples, shares

    loop._score = recording  # type: ignore[method-assign]
    history = [h for h in loop.run().history if "critic/score/mean" in h]
    assert len(history) == 2
    assert set(drawn) == {8}  # gen_batch_size prompts per round
    assert any(s.overlong < 0 for s in scored)
    for s in scored:
        n = len(s.token_ids)
        assert s.overlong == min(-(n - (8 - 4)) / 4 * 1.0, 0)  # verl's formula
    for h in history:
        assert h["reward/overlong_reward/mean"] <= 0.0
        assert 0.0 <= h["reward/overlong/mean"] <= 1.0


@pytest.mark.e2e
def test_bypass_mode_anchors_on_the_rollout_and_rescores_nothing(
    assets: Path, tmp_path: Path
) -> None:
    """bypass_mode: the engine's (perturbed) logprobs are PPO's anchor, so no old-logprob pass
    runs (no timing_s/old_log_prob) and the trainer measures the mismatch inside the loss:
    KL -1, the weights' mean e; REINFORCE with weights truncated at 2 trains the step."""
    bypass = {
        "algorithm.rollout_correction.bypass_mode": "true",
        "algorithm.rollout_correction.loss_type": "reinforce",
        "algorithm.rollout_correction.rollout_is": "token",
    }
    (step,) = _run(assets, tmp_path, 1, **bypass)
    assert "timing_s/old_log_prob" not in step
    assert "training/rollout_probs_diff_mean" not in step  # the trainer never rescored
    assert step["rollout_corr/kl"] == pytest.approx(-SHIFT, abs=1e-3)
    assert step["rollout_corr/rollout_is_mean"] == pytest.approx(math.e, rel=1e-3)
    assert step["actor/grad_norm"] > 0
