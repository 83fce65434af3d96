"""Bad input on every path fails before any work, naming the culprit, and writes nothing.

One table: each case builds one bad thing next to a good tiny Llama and its data, runs the
entry point the CLI runs (`preflight.load` then `preflight.check`), and checks the message for
the facts a user needs; every case also checks that no file appeared or changed anywhere under
the test's directories (so no run dir, checkpoint or metrics file). One case goes through the
CLI in a subprocess.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from patrl.orchestrator import preflight
from patrl.orchestrator.config import ConfigError
from patrl.orchestrator.main import main
from patrl.rollout.loader import expected_shapes
from patrl.rollout.model_config import ModelArch
from patrl_testkit import filesystems
from patrl_testkit.models import save_tiny_model, save_tiny_reward_model, tiny_config

POSITIONS = 128  # max_position_embeddings of every model here
NUM_TRAIN = 16


@dataclass(frozen=True)
class Assets:
    root: Path
    model: Path  # a good tiny Llama with the demo's tokenizer
    other_model: Path  # same family, intermediate_size 96
    checkpoint: Path  # a run checkpoint of `model`, saved by one rank
    other_checkpoint: Path  # a run checkpoint of `other_model`, saved by one rank


def _save_llama(path: Path, **changes: Any) -> None:
    from patrl_examples.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    save_tiny_model(
        path, "llama", "plain", tokenizer=tok, max_position_embeddings=POSITIONS, **changes
    )


def _save_run_checkpoint(model_dir: Path, checkpoint: Path) -> None:
    from patrl.orchestrator import run_checkpoint
    from patrl.trainer import Trainer, TrainerConfig

    Trainer(TrainerConfig(), str(model_dir)).save(checkpoint / run_checkpoint.TRAINER_DIR)
    (checkpoint / run_checkpoint.STATE_FILE).write_text(json.dumps({"step": 1}))


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    root = tmp_path_factory.mktemp("bad_input")
    out = Assets(
        root,
        root / "model",
        root / "other_model",
        root / "ckpt" / "global_step_1",
        root / "other_ckpt" / "global_step_1",
    )
    _save_llama(out.model)
    _save_llama(out.other_model, intermediate_size=96)
    _save_run_checkpoint(out.model, out.checkpoint)
    _save_run_checkpoint(out.other_model, out.other_checkpoint)
    rng = random.Random(0)
    for split, count in (("train", NUM_TRAIN), ("val", 4)):
        with (root / f"{split}.jsonl").open("w") as f:
            for _ in range(count):
                a, b = rng.randint(0, 9), rng.randint(0, 9)
                f.write(json.dumps({"prompt": f"{a}+{b}=?", "answer": str(a + b)}) + "\n")
    return out


@dataclass(frozen=True)
class Setup:
    """What a case hands the entry point."""

    overrides: dict[str, Any]
    config_text: str | None = None  # the YAML file's text, when the case uses one
    world_size: int = 1
    local_world_size: int | None = None


def _good(assets: Assets, run_root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "model.path": assets.model,
        "data.train_files": assets.root / "train.jsonl",
        "data.val_files": assets.root / "val.jsonl",
        "data.train_batch_size": 4,
        "data.max_prompt_length": 32,
        "data.max_response_length": 64,
        "actor.ppo_mini_batch_size": 2,
        "trainer.default_local_dir": run_root,
        **extra,
    }


def _model_copy(assets: Assets, tmp: Path) -> Path:
    return Path(shutil.copytree(assets.model, tmp / "model"))


def _edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_tensors(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# Each builder: (assets, a scratch dir for the bad thing, the run root) -> Setup.
Builder = Callable[[Assets, Path, Path], Setup]


def malformed_yaml(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run), "data:\n  train_batch_size: 4\n\tmax_prompt_length: 32\n")


def unknown_yaml_key(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run), "rollout:\n  n: 4\n  temprature: 0.5\n")


def unknown_override_key(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"rollout.tempreature": 0.5}))


def unknown_key_in_a_list(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run), "reward:\n  functions:\n    - name: format\n    - nme: x\n")


def wrong_type(a: Assets, tmp: Path, run: Path) -> Setup:
    overrides = _good(a, run)
    del overrides["data.train_batch_size"]
    return Setup(overrides, "data:\n  shuffle: true\n  train_batch_size: many\n")


def missing_model_dir(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"model.path": tmp / "no_such_model"}))


def no_config_json(a: Assets, tmp: Path, run: Path) -> Setup:
    model = _model_copy(a, tmp)
    (model / "config.json").unlink()
    return Setup(_good(a, run, **{"model.path": model}))


def unsupported_family(a: Assets, tmp: Path, run: Path) -> Setup:
    model = _model_copy(a, tmp)
    _edit_config(model, model_type="gpt2")
    return Setup(_good(a, run, **{"model.path": model}))


def tensor_shape_mismatch(a: Assets, tmp: Path, run: Path) -> Setup:
    model = _model_copy(a, tmp)
    _edit_config(model, intermediate_size=96)
    return Setup(_good(a, run, **{"model.path": model}))


def corrupt_safetensors(a: Assets, tmp: Path, run: Path) -> Setup:
    model = _model_copy(a, tmp)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    return Setup(_good(a, run, **{"model.path": model}))


def missing_tensor(a: Assets, tmp: Path, run: Path) -> Setup:
    model = _model_copy(a, tmp)
    _edit_tensors(model, lambda t: t.pop("model.norm.weight"))
    return Setup(_good(a, run, **{"model.path": model}))


def unexpected_tensor(a: Assets, tmp: Path, run: Path) -> Setup:
    model = _model_copy(a, tmp)
    _edit_tensors(model, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    return Setup(_good(a, run, **{"model.path": model}))


def missing_data_file(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"data.train_files": tmp / "trian.jsonl"}))


def missing_column(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"data.prompt_key": "question"}))


def all_prompts_overlong(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"data.max_prompt_length": 3}))


def batch_larger_than_data(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"data.train_batch_size": 32, "actor.ppo_mini_batch_size": 32}))


def checkpoint_of_other_model(a: Assets, tmp: Path, run: Path) -> Setup:
    extra = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": a.other_checkpoint}
    return Setup(_good(a, run, **extra))


def auto_resume_other_model(a: Assets, tmp: Path, run: Path) -> Setup:
    # The run dir already holds a checkpoint (of another model) that auto-resume would pick.
    shutil.copytree(a.other_checkpoint, run / "global_step_1")
    return Setup(_good(a, run))


def checkpoint_without_optimizer(a: Assets, tmp: Path, run: Path) -> Setup:
    from patrl.orchestrator import run_checkpoint
    from patrl.trainer.checkpoint import MARKER

    checkpoint = Path(shutil.copytree(a.checkpoint, tmp / "global_step_1"))
    marker = checkpoint / run_checkpoint.TRAINER_DIR / MARKER
    saved = json.loads(marker.read_text())
    marker.write_text(json.dumps({**saved, "contents": ["model", "hf_model"]}))
    extra = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": checkpoint}
    return Setup(_good(a, run, **extra))


def not_a_checkpoint(a: Assets, tmp: Path, run: Path) -> Setup:
    extra = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": tmp}
    return Setup(_good(a, run, **extra))


STATIC = {"rollout.adaptive_tp.enable": False}


def tp_not_dividing_world(a: Assets, tmp: Path, run: Path) -> Setup:
    extra = {**STATIC, "rollout.tensor_model_parallel_size": 3}
    return Setup(_good(a, run, **extra), world_size=2)


def tp_beyond_heads(a: Assets, tmp: Path, run: Path) -> Setup:
    extra = {**STATIC, "rollout.tensor_model_parallel_size": 8}
    return Setup(_good(a, run, **extra), world_size=8)


def tp_straddling_nodes(a: Assets, tmp: Path, run: Path) -> Setup:
    setup = _good(a, run, **{**STATIC, "rollout.tensor_model_parallel_size": 2})
    return Setup(setup, world_size=6, local_world_size=3)


def adaptive_candidate_beyond_heads(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"rollout.adaptive_tp.candidates": "[1,8]"}), world_size=8)


def adaptive_profile_missing(a: Assets, tmp: Path, run: Path) -> Setup:
    extra = {"rollout.adaptive_tp.profile": tmp / "nowhere.json"}
    return Setup(_good(a, run, **extra), world_size=2)


def spec_profile_missing(a: Assets, tmp: Path, run: Path) -> Setup:
    extra = {
        "rollout.speculative.enable": "true",
        "rollout.speculative.latency_profile": tmp / "nowhere.json",
    }
    return Setup(_good(a, run, **extra))


def async_without_trainer(a: Assets, tmp: Path, run: Path) -> Setup:
    extra = {"trainer.mode": "async", "async_rl.rollout_ranks": 2}
    return Setup(_good(a, run, **extra), world_size=2)


def _reward_model(path: Path, **extra: Any) -> dict[str, Any]:
    return {"reward_model.enable": "true", "reward_model.model.path": path, **extra}


def _save_rm(path: Path, num_labels: int = 1) -> Path:
    from patrl_examples.demo.tokenizer import build_tokenizer

    return save_tiny_reward_model(path, build_tokenizer(), num_labels=num_labels)


def rm_without_path(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"reward_model.enable": "true"}))


def rm_not_sequence_classification(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **_reward_model(a.model)))


def rm_two_labels(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **_reward_model(_save_rm(tmp / "rm2", num_labels=2))))


def rm_without_tokenizer(a: Assets, tmp: Path, run: Path) -> Setup:
    rm = _save_rm(tmp / "rm_bare")
    for f in rm.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    return Setup(_good(a, run, **_reward_model(rm)))


def several_at_once(a: Assets, tmp: Path, run: Path) -> Setup:
    extra = {**STATIC, "data.answer_key": "solution", "rollout.tensor_model_parallel_size": 2}
    return Setup(_good(a, run, **extra), world_size=3)


def world_not_as_configured(a: Assets, tmp: Path, run: Path) -> Setup:
    extra = {"trainer.n_gpus_per_node": 8, "trainer.nnodes": 1}
    return Setup(_good(a, run, **extra), world_size=2, local_world_size=2)


def verl_offload_in_yaml(a: Assets, tmp: Path, run: Path) -> Setup:
    text = "actor_rollout_ref:\n  actor:\n    fsdp_config:\n      param_offload: true\n"
    return Setup(_good(a, run), text)


def verl_unknown_key(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"actor_rollout_ref.actor.optim.lrr": 1e-6}))


def model_without_train_files(a: Assets, tmp: Path, run: Path) -> Setup:
    overrides = _good(a, run)
    del overrides["data.train_files"], overrides["data.val_files"]
    return Setup(overrides)


def missing_reward_file(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"custom_reward_function.path": tmp / "my_reward.py"}))


def nested_answer_key_wrong(a: Assets, tmp: Path, run: Path) -> Setup:
    rows = [{"prompt": "1+2=?", "reward_model": {"style": "rule", "ground_truth": "3"}}] * 8
    (tmp / "verl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = {
        "data.train_files": tmp / "verl.jsonl",
        "data.val_files": tmp / "verl.jsonl",
        "data.answer_key": "reward_model.answer",
    }
    return Setup(_good(a, run, **extra))


def infinite_learning_rate(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"actor.optim.lr": "inf"}))


def in_process_reward_with_timeout(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"reward.num_workers": 0, "reward.timeout_s": 5}))


def reward_function_not_importable(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"reward.functions": "[{name: 'no_such_module_xyz:score'}]"}))


def reward_function_not_callable(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"reward.functions": "[{name: 'json:decoder'}]"}))


def lengths_beyond_positions(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"data.max_response_length": POSITIONS}))


def model_path_is_a_file(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"model.path": a.model / "config.json"}))


def empty_jsonl(a: Assets, tmp: Path, run: Path) -> Setup:
    (tmp / "empty.jsonl").write_text("")
    return Setup(_good(a, run, **{"data.train_files": tmp / "empty.jsonl"}))


def malformed_jsonl_line(a: Assets, tmp: Path, run: Path) -> Setup:
    lines = (a.root / "train.jsonl").read_text().splitlines()
    lines[2] = lines[2][:-3]  # the third row cut short
    (tmp / "broken.jsonl").write_text("\n".join(lines) + "\n")
    return Setup(_good(a, run, **{"data.train_files": tmp / "broken.jsonl"}))


def command_line_value_in_a_yaml_section(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(
        _good(a, run, **{"data.train_batch_size": "many"}),
        "data:\n  shuffle: true\n  train_batch_size: 4\n",
    )


def tokenizer_beyond_the_vocabulary(a: Assets, tmp: Path, run: Path) -> Setup:
    model = _model_copy(a, tmp)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for i in range(200):
        vocab[f"extra_token_{i}"] = len(vocab)
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return Setup(_good(a, run, **{"model.path": model}))


def explicit_candidate_the_heads_refuse(a: Assets, tmp: Path, run: Path) -> Setup:
    model = _model_copy(a, tmp)
    _three_heads(model)
    return Setup(
        _good(a, run, **{"model.path": model, "rollout.adaptive_tp.candidates": "[1,2]"}),
        world_size=2,
    )


def _three_heads(model: Path) -> None:
    """A fresh tiny Llama of 3 attention heads (and 3 kv heads) in `model`."""
    shutil.rmtree(model)
    _save_llama(model, hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=16)


def damaged_checkpoint(a: Assets, tmp: Path, run: Path) -> Setup:
    from patrl.orchestrator import run_checkpoint

    checkpoint = Path(shutil.copytree(a.checkpoint, tmp / "global_step_1"))
    run_checkpoint.write_manifest(checkpoint)
    shard = next((checkpoint / run_checkpoint.TRAINER_DIR).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])  # a shard cut short
    extra = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": checkpoint}
    return Setup(_good(a, run, **extra))


def critic_vocab_smaller(a: Assets, tmp: Path, run: Path) -> Setup:
    _save_llama(tmp / "critic", vocab_size=64)  # the policy's tokenizer has 128 tokens
    extra = {"algorithm.adv_estimator": "gae", "critic.model.path": tmp / "critic"}
    return Setup(_good(a, run, **extra))


ASYNC = {"trainer.mode": "async", "async_rl.rollout_ranks": 1}


def async_on_one_rank(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **ASYNC))


def async_remax(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **ASYNC, **{"algorithm.adv_estimator": "remax"}), world_size=2)


def async_val_only(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **ASYNC, **{"trainer.val_only": "true"}), world_size=2)


def async_sharded_reward_model(a: Assets, tmp: Path, run: Path) -> Setup:
    rm = _reward_model(_save_rm(tmp / "rm"), **{"reward_model.strategy": "fsdp"})
    return Setup(_good(a, run, **ASYNC, **rm), world_size=2)


def run_dir_under_a_file(a: Assets, tmp: Path, run: Path) -> Setup:
    (tmp / "afile").write_text("")
    return Setup(_good(a, run, **{"trainer.default_local_dir": tmp / "afile" / "runs"}))


def kv_cache_below_one_sequence(a: Assets, tmp: Path, run: Path) -> Setup:
    return Setup(_good(a, run, **{"rollout.num_kv_blocks": 1, "rollout.block_size": 4}))


CASES: list[tuple[Builder, list[str]]] = [
    (
        kv_cache_below_one_sequence,
        [
            "rollout.num_kv_blocks=1 x rollout.block_size=4 = 4 tokens of KV cache",
            "= 96 tokens",
            "rollout.num_kv_blocks >= 24",
        ],
    ),
    (
        critic_vocab_smaller,
        [
            "critic.model.path=",
            "its vocab_size=64 but the policy's tokenizer (model.path) has 128 tokens",
            "token ids 64 to 127",
        ],
    ),
    (
        async_on_one_rank,
        ["trainer.mode=async needs at least 2 ranks", "has 1", "torchrun --nproc_per_node 2"],
    ),
    (
        async_remax,
        ["trainer.mode=async does not support algorithm.adv_estimator=remax", "trainer.mode=sync"],
    ),
    (
        async_val_only,
        ["trainer.mode=async does not run trainer.val_only=true", "use trainer.mode=sync"],
    ),
    (
        async_sharded_reward_model,
        [
            "trainer.mode=async does not support reward_model.strategy=fsdp",
            "use reward_model.strategy=replicated",
        ],
    ),
    (
        run_dir_under_a_file,
        ["trainer.default_local_dir: the run directory", "afile is a file, not a directory"],
    ),
    (infinite_learning_rate, ["actor.optim.lr", "finite number", "'inf'"]),
    (in_process_reward_with_timeout, ["reward.timeout_s=5.0 needs reward worker processes"]),
    (
        reward_function_not_importable,
        ["reward.functions", "no_such_module_xyz:score", "cannot import"],
    ),
    (reward_function_not_callable, ["reward.functions", "json:decoder", "not callable"]),
    (
        lengths_beyond_positions,
        [
            "data.max_prompt_length=32 + data.max_response_length=128",
            "max_position_embeddings=128",
        ],
    ),
    (model_path_is_a_file, ["model.path", "config.json is a file, expected a directory"]),
    (empty_jsonl, ["data.train_files", "empty.jsonl", "no rows"]),
    (malformed_jsonl_line, ["data.train_files", "broken.jsonl line 3", "not valid JSON"]),
    (
        command_line_value_in_a_yaml_section,
        ["data.train_batch_size", "'many'", "set on the command line"],
    ),
    (
        tokenizer_beyond_the_vocabulary,
        ["model.path", "tokenizer has", "vocab_size=", "token ids past the embedding"],
    ),
    (
        explicit_candidate_the_heads_refuse,
        ["rollout.adaptive_tp.candidates=2", "num_attention_heads=3"],
    ),
    (
        damaged_checkpoint,
        ["trainer.resume_from_path", "is damaged", ".distcp is", "its manifest says"],
    ),
    (malformed_yaml, ["job.yaml line 3, column 1", "malformed YAML", "'\\t'"]),
    (
        unknown_yaml_key,
        ["job.yaml line 3", "unknown key 'rollout.temprature'", "did you mean temperature"],
    ),
    (unknown_override_key, ["unknown key 'rollout.tempreature'", "did you mean temperature"]),
    (
        unknown_key_in_a_list,
        ["job.yaml line 4", "unknown key 'reward.functions.1.nme'", "did you mean name"],
    ),
    (
        wrong_type,
        ["data.train_batch_size", "valid integer", "'many'", "set in {yaml} line 3"],
    ),
    (missing_model_dir, ["model.path", "no_such_model", "does not exist"]),
    (no_config_json, ["model.path", "has no config.json", "model.safetensors"]),
    (unsupported_family, ["model_type 'gpt2' is not supported", "['llama', 'qwen2', 'qwen3']"]),
    (
        tensor_shape_mismatch,
        [
            "'model.layers.0.mlp.gate_proj.weight' has shape [128, 64] in model.safetensors",
            "config.json implies [96, 64]",
        ],
    ),
    (corrupt_safetensors, ["model.safetensors is not a readable safetensors file"]),
    (missing_tensor, ["1 tensors missing", "model.norm.weight"]),
    (unexpected_tensor, ["does not have", "model.layers.0.mlp.extra.weight"]),
    (missing_data_file, ["data.train_files", "trian.jsonl", "does not exist"]),
    (
        missing_column,
        [
            "data.train_files",
            "prompt column 'question' not found",
            "train.jsonl",
            "['prompt', 'answer']",
        ],
    ),
    (
        all_prompts_overlong,
        [f"all {NUM_TRAIN} rows were filtered as overlong", "data.max_prompt_length=3"],
    ),
    (batch_larger_than_data, ["data.train_batch_size=32", f"leaves {NUM_TRAIN} prompts"]),
    (
        checkpoint_of_other_model,
        [
            "trainer.resume_from_path",
            "holds a different model than model.path",
            "intermediate_size is 96 in the checkpoint, 128 in the model",
            "'model.layers.0.mlp.down_proj.weight' is [64, 96] in the checkpoint",
        ],
    ),
    (
        auto_resume_other_model,
        ["trainer.resume_mode", "global_step_1", "intermediate_size is 96 in the checkpoint"],
    ),
    (
        checkpoint_without_optimizer,
        [
            "trainer.resume_from_path",
            "cannot be resumed",
            "actor.checkpoint.save_contents=['model', 'hf_model']",
            "resuming needs ['model', 'optimizer', 'extra']",
        ],
    ),
    (not_a_checkpoint, ["trainer.resume_from_path", "not a complete patrl checkpoint"]),
    (
        tp_not_dividing_world,
        [
            "rollout.tensor_model_parallel_size=3 fits no layout of world size 2",
            "does not divide the world size 2",
            "one of [1, 2]",
        ],
    ),
    (
        tp_beyond_heads,
        [
            "rollout.tensor_model_parallel_size=8 fits no layout of world size 8",
            "num_attention_heads=4",
            "one of [1, 2, 4]",
        ],
    ),
    (
        tp_straddling_nodes,
        [
            "rollout.tensor_model_parallel_size=2 fits no layout of world size 6",
            "straddle nodes of 3 ranks",
            "one of [1]",
        ],
    ),
    (
        adaptive_candidate_beyond_heads,
        [
            "rollout.adaptive_tp.candidates=8 fits no layout of world size 8",
            "num_attention_heads=4",
        ],
    ),
    (adaptive_profile_missing, ["rollout.adaptive_tp.profile=", "nowhere.json: no such file"]),
    (
        spec_profile_missing,
        ["rollout.speculative.latency_profile=", "nowhere.json: no such file"],
    ),
    (async_without_trainer, ["async_rl.rollout_ranks=2 leaves no trainer rank", "use 1..1"]),
    (
        rm_without_path,
        ["reward_model.enable=true needs reward_model.model.path"],
    ),
    (
        rm_not_sequence_classification,
        [
            "reward_model.model.path=",
            "config.json lists architectures ['LlamaForCausalLM']",
            "num_labels=1",
        ],
    ),
    (rm_two_labels, ["reward_model.model.path=", "rm2", "has num_labels=2"]),
    (
        rm_without_tokenizer,
        ["reward_model.model.path=", "rm_bare", "no usable tokenizer", "holds no tokenizer files"],
    ),
    (
        world_not_as_configured,
        [
            "trainer.n_gpus_per_node=8 do not match the world torchrun started",
            "WORLD_SIZE=2 with LOCAL_WORLD_SIZE=2",
            "torchrun --nnodes 1 --nproc_per_node 8",
        ],
    ),
    (
        verl_offload_in_yaml,
        [
            "verl's actor_rollout_ref.actor.fsdp_config.param_offload=True is not supported by "
            "patrl: patrl's FSDP2 trainer keeps parameters and optimizer state on the device",
            "use more ranks",
        ],
    ),
    (
        verl_unknown_key,
        [
            "unknown key 'actor_rollout_ref.actor.optim.lrr' (patrl's 'actor.optim.lrr')",
            "did you mean lr",
        ],
    ),
    (
        model_without_train_files,
        [
            "is set but data.train_files is not",
            "on the embedded demo task",
            "data.train_files=demo",
        ],
    ),
    (missing_reward_file, ["reward.functions.0.name", "my_reward.py", "no such file"]),
    (
        nested_answer_key_wrong,
        [
            "answer column 'reward_model.answer' not found",
            "['prompt', 'reward_model.style', 'reward_model.ground_truth']",
        ],
    ),
    (
        several_at_once,
        [
            "3 problems",
            "data.train_files: answer column 'solution' not found",
            "data.val_files: answer column 'solution' not found",
            "does not divide the world size 3",
        ],
    ),
]


def _snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under `roots`, with size and modification time."""
    out = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            stat = path.stat()
            out[str(path)] = (stat.st_size if path.is_file() else -1, stat.st_mtime_ns)
    return out


def _setup(build: Builder, assets: Assets, tmp_path: Path) -> tuple[Setup, Path | None, Path]:
    run_root = tmp_path / "runs"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    setup = build(assets, scratch, run_root)
    yaml_path = None
    if setup.config_text is not None:
        yaml_path = tmp_path / "job.yaml"
        yaml_path.write_text(setup.config_text)
    return setup, yaml_path, run_root


def _overrides(setup: Setup) -> list[str]:
    return [f"{k}={v}" for k, v in setup.overrides.items()]


@pytest.mark.parametrize(("build", "facts"), CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_input_fails_before_work_naming_the_culprit(
    build: Builder, facts: list[str], assets: Assets, tmp_path: Path
) -> None:
    setup, yaml_path, run_root = _setup(build, assets, tmp_path)
    before = _snapshot(tmp_path, assets.root)
    with pytest.raises(ConfigError) as info:
        config = preflight.load(yaml_path, _overrides(setup))
        preflight.check(config, setup.world_size, setup.local_world_size)
    message = str(info.value)
    for fact in facts:
        assert fact.format(yaml=yaml_path) in message, f"{fact!r} not in:\n{message}"
    assert _snapshot(tmp_path, assets.root) == before, "preflight wrote or changed a file"
    assert not (run_root / "metrics.jsonl").exists()


def test_good_input_passes(assets: Assets, tmp_path: Path) -> None:
    """The table's control: the same setup without the bad thing passes, resuming a checkpoint
    of the same model included (saved by one rank, resumable by two), and creates no run dir."""
    extra = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": assets.checkpoint}
    overrides = _good(assets, tmp_path / "runs", **extra)
    for world_size in (1, 2):
        preflight.check(
            preflight.load(None, [f"{k}={v}" for k, v in overrides.items()]), world_size
        )
    assert main(["--dry-run", *[f"{k}={v}" for k, v in overrides.items()]]) == 0
    assert not (tmp_path / "runs").exists()


def test_default_candidates_drop_the_sizes_the_model_cannot_split(
    assets: Assets, tmp_path: Path
) -> None:
    """3 heads on 2 ranks: the default candidates [1, 2] keep only 1 (the job runs static TP);
    an explicit [1, 2] is the user's choice and fails by name (the table's case)."""
    from patrl.orchestrator.build import tp_candidates

    model = tmp_path / "three"
    model.mkdir()
    _three_heads(model)
    overrides = _good(assets, tmp_path / "runs", **{"model.path": model})
    config = preflight.check(preflight.load(None, [f"{k}={v}" for k, v in overrides.items()]), 2)
    assert tp_candidates(config, 2, 2, str(model)) == (1,)
    explicit = preflight.load(
        None, [*_overrides(Setup(overrides)), "rollout.adaptive_tp.candidates=[1,2]"]
    )
    assert tp_candidates(explicit, 2, 2, str(model)) == (1, 2)


@pytest.mark.parametrize(
    ("world_size", "local", "tp"),
    [(2, 2, 1), (2, 2, 2), (4, 4, 2), (4, 2, 2), (6, 6, 2), (8, 2, 2), (8, 4, 4)],
)
def test_layouts_that_fit_pass(
    assets: Assets, tmp_path: Path, world_size: int, local: int, tp: int
) -> None:
    """4 heads, 2 kv heads: a TP size dividing the world, the heads and the ranks per node
    (a TP group stays inside one node) is accepted."""
    overrides = _good(
        assets, tmp_path / "runs", **{**STATIC, "rollout.tensor_model_parallel_size": tp}
    )
    config = preflight.load(None, [f"{k}={v}" for k, v in overrides.items()])
    preflight.check(config, world_size, local)


@pytest.mark.parametrize(("world_size", "local", "tp"), [(4, 2, 4), (8, 2, 4), (2, 1, 2)])
def test_a_tp_larger_than_a_node_is_refused_naming_both(
    assets: Assets, tmp_path: Path, world_size: int, local: int, tp: int
) -> None:
    """A TP group made of whole nodes would run its per-layer collectives across nodes: an
    error naming the TP size and LOCAL_WORLD_SIZE, and the sizes that fit."""
    overrides = _good(
        assets, tmp_path / "runs", **{**STATIC, "rollout.tensor_model_parallel_size": tp}
    )
    config = preflight.load(None, [f"{k}={v}" for k, v in overrides.items()])
    with pytest.raises(ConfigError) as info:
        preflight.check(config, world_size, local)
    message = str(info.value)
    assert f"rollout.tensor_model_parallel_size={tp} fits no layout" in message
    assert f"larger than a node (LOCAL_WORLD_SIZE={local})" in message
    fits = [t for t in (1, 2, 4) if local % t == 0]
    assert f"one of {fits}" in message


def test_adaptive_folds_larger_than_a_node_are_not_offered(assets: Assets, tmp_path: Path) -> None:
    """Adaptive candidates [1, 2, 4] on two nodes of 2: the fold of 4 is dropped (as the job
    drops it), not reported, so the job starts."""
    extra = {"rollout.adaptive_tp.candidates": "[1,2,4]"}
    overrides = _good(assets, tmp_path / "runs", **extra)
    preflight.check(preflight.load(None, [f"{k}={v}" for k, v in overrides.items()]), 4, 2)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_expected_shapes_match_transformers(family: str) -> None:
    """The slow twin of `expected_shapes`: the state dict of the transformers model itself."""
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    config = tiny_config(
        family,
        "plain",
        vocab_size=96,
        tie_word_embeddings=family == "qwen3",
        max_position_embeddings=POSITIONS,
    )
    with torch.device("meta"):
        hf = getattr(transformers, f"{name}ForCausalLM")(config)
    reference = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    shapes, optional = expected_shapes(ModelArch.from_hf(config))
    assert optional == ({"lm_head.weight"} if family == "qwen3" else set())
    assert shapes == {k: v for k, v in reference.items() if k not in optional}


def test_cli_reports_bad_input_without_a_traceback(assets: Assets, tmp_path: Path) -> None:
    """`--dry-run` through the real CLI: exit code 2, every problem on stderr (a data one, so
    the data files are read, and a layout one), and nothing else there, no traceback."""
    config = tmp_path / "job.yaml"
    config.write_text("data:\n  prompt_key: question\nrollout:\n  tensor_model_parallel_size: 3\n")
    overrides = _good(assets, tmp_path / "runs")
    before = _snapshot(tmp_path, assets.root)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        env.pop(var, None)
    done = subprocess.run(
        [sys.executable, "-m", "patrl.orchestrator", "--config", str(config), "--dry-run"]
        + [f"{k}={v}" for k, v in overrides.items()],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""  # the config is not printed when it is bad
    lines = done.stderr.splitlines()
    assert lines[0] == "patrl: 3 problems:", done.stderr
    assert all(line.startswith("  - ") for line in lines[1:]), done.stderr
    assert "data.train_files: prompt column 'question' not found" in done.stderr
    assert "data.val_files: prompt column 'question' not found" in done.stderr
    assert "tensor_model_parallel_size=3 fits no layout of world size 1" in done.stderr
    assert _snapshot(tmp_path, assets.root) == before


def test_a_verl_key_on_the_command_line_is_blamed_on_the_command_line(
    assets: Assets, tmp_path: Path
) -> None:
    """verl's spelling of a key, set on the command line with a YAML that has the section:
    the command line is named, not the YAML's section line (as for the patrl spelling)."""
    config = tmp_path / "job.yaml"
    config.write_text("rollout:\n  n: 4\n")
    for key in (
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "rollout.gpu_memory_utilization",
    ):
        overrides = [*_overrides(Setup(_good(assets, tmp_path / "runs"))), f"{key}=1.5"]
        with pytest.raises(ConfigError) as info:
            preflight.load(config, overrides)
        message = str(info.value)
        assert "gpu_memory_utilization" in message and "1.5" in message, message
        assert "(rollout.gpu_memory_utilization is set on the command line)" in message, message
        assert "job.yaml line" not in message, message


def test_a_section_check_is_blamed_on_the_keys_set_beneath_it(
    assets: Assets, tmp_path: Path
) -> None:
    """A check of a whole section (rollout_correction's options with their thresholds) names
    the keys set beneath it where they were set, not the YAML line of a parent section."""
    config = tmp_path / "job.yaml"
    config.write_text("algorithm:\n  adv_estimator: grpo\n")
    overrides = [
        *_overrides(Setup(_good(assets, tmp_path / "runs"))),
        "algorithm.rollout_correction.rollout_rs=token_k9",
    ]
    with pytest.raises(ConfigError) as info:
        preflight.load(config, overrides)
    message = str(info.value)
    assert "'token_k9' is unknown" in message, message
    assert "Value error" not in message and "(config)" not in message, message
    assert "(algorithm.rollout_correction.rollout_rs is set on the command line)" in message, (
        message
    )
    assert "job.yaml line" not in message, message


def test_speculation_with_adaptive_tp_passes_preflight(assets: Assets, tmp_path: Path) -> None:
    """Speculation composes with adaptive TP (a fold makes the merged group's drafters alike:
    `Drafter.merge_reset`): a job that would fold (2 ranks, adaptive TP on) passes preflight,
    as does one at static TP."""
    overrides = _overrides(Setup(_good(assets, tmp_path / "runs")))
    spec = [*overrides, "rollout.speculative.enable=true", "rollout.adaptive_tp.enable=true"]
    preflight.check(preflight.load(None, spec), 2)
    static = [*spec, "rollout.adaptive_tp.enable=false"]
    preflight.check(preflight.load(None, static), 2)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    with filesystems.read_only_dir(tmp_path / "ro") as path:
        yield path


def test_a_run_dir_that_cannot_be_written_is_refused_before_any_rank_starts(
    assets: Assets, read_only_dir: Path
) -> None:
    """A run directory on a read-only filesystem (or one not writable) fails in preflight,
    naming the key and the directory, instead of as OSError tracebacks from every rank."""
    for run_dir in (read_only_dir, read_only_dir / "project" / "run"):
        overrides = _good(assets, run_dir)
        with pytest.raises(ConfigError) as info:
            preflight.check(preflight.load(None, _overrides(Setup(overrides))), 2)
        message = str(info.value)
        assert (
            f"trainer.default_local_dir: the run directory {run_dir} cannot be written" in message
        )
        assert str(read_only_dir) in message
        assert "read-only filesystem" in message or "is not writable" in message, message


def test_data_is_checked_before_the_demo_model_is_built(
    assets: Assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No demo model cached (an empty cache dir) and data of the user's own: an empty or
    missing train file is named by preflight at once, with the demo's tokenizer, not after
    the demo's build; nothing is built or written."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("PATRL_CACHE_DIR", str(cache))
    (tmp_path / "empty.jsonl").write_text("")
    cases = [
        ("[]", ["data.train_files=[] names no file", ".jsonl"]),
        ("''", ["data.train_files='' names no file"]),
        (tmp_path / "empty.jsonl", ["data.train_files: no rows in", "empty.jsonl"]),
        (tmp_path / "nowhere.jsonl", ["data.train_files", "nowhere.jsonl", "does not exist"]),
    ]
    for train, facts in cases:
        overrides = _good(assets, tmp_path / "runs", **{"data.train_files": train})
        del overrides["model.path"]
        with pytest.raises(ConfigError) as info:
            preflight.check(preflight.load(None, _overrides(Setup(overrides))), 1)
        for fact in facts:
            assert fact in str(info.value), str(info.value)
    assert list(cache.iterdir()) == [] and not (tmp_path / "runs").exists()
    # the control: good data passes with the demo still unbuilt
    good = _good(assets, tmp_path / "runs")
    del good["model.path"]
    preflight.check(preflight.load(None, _overrides(Setup(good))), 1)
    assert list(cache.iterdir()) == []
