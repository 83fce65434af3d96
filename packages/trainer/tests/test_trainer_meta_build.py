"""The meta-device sharded build (model.build_sharded) against its slow twin, the whole-model
path (`from_pretrained` on every rank, then FSDP2), on 2 gloo ranks: same weights bit for bit,
same buffers, same ties, and the same train step; and FSDP2 mixed precision (bf16 params)."""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from trainer_testkit import VOCAB, config, full_weights, make_batch, whole_model_build

from patrl.trainer import Trainer
from patrl.trainer.model import build_hf_model
from patrl.trainer.shard_loader import INDEX_FILE
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks

pytestmark = pytest.mark.multirank

# One more row than make_batch's token range: the vocab rows split unevenly over 2 ranks.
ROWS = VOCAB + 1
CFG: dict[str, Any] = {"ppo_max_token_len_per_gpu": 40, "entropy_coeff": 0.01}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tied Qwen2 (qkv bias), untied Llama (llama3 rope) in several files with an index, and
    a bf16 tied Qwen2; biases and norms randomised."""
    root = tmp_path_factory.mktemp("meta_build")
    qwen2 = tiny_hf_model("qwen2", seed=1, vocab_size=ROWS)
    llama = tiny_hf_model("llama", seed=2, vocab_size=ROWS)
    dirs = {
        "tied": save_hf_model(qwen2, root / "tied"),
        "untied": save_hf_model(llama, root / "untied", max_shard_size="40KB"),
        "bf16": save_hf_model(tiny_hf_model("qwen2", 3, vocab_size=ROWS).bfloat16(), root / "bf"),
    }
    assert (dirs["untied"] / INDEX_FILE).is_file()
    assert qwen2.config.tie_word_embeddings and not llama.config.tie_word_embeddings
    return {k: str(v) for k, v in dirs.items()}


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {n: t.detach().numpy().copy() for n, t in tensors.items()}


def _state(trainer: Trainer) -> dict[str, Any]:
    model = trainer.model
    return {
        "weights": _numpy(full_weights(trainer)),
        "buffers": _numpy(dict(model.named_buffers())),
        "tied": model.lm_head.weight is model.get_input_embeddings().weight,
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "checkpointing": model.is_gradient_checkpointing,
    }


def _build_and_step(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name in ("meta", "whole"):
        patch = mock.patch("patrl.trainer.trainer.build_sharded", whole_model_build)
        with patch if name == "whole" else contextlib.nullcontext():
            cfg = config(**CFG, use_kl_loss=True, enable_gradient_checkpointing=True)
            trainer = Trainer(cfg, model_dir, mesh)
        built = _state(trainer)
        metrics = trainer.train_step(make_batch(0, [5, 9, 3, 12, 7], with_old=True))
        out[name] = {**built, "metrics": metrics, "stepped": _numpy(full_weights(trainer))}
    return out


@pytest.mark.parametrize("kind", ["tied", "untied", "bf16"])
def test_meta_build_equals_whole_model_build_bit_for_bit(
    checkpoints: dict[str, str], kind: str
) -> None:
    for got in run_ranks(_build_and_step, 2, args=(checkpoints[kind],), timeout_s=240):
        meta, whole = got["meta"], got["whole"]
        assert meta["sharded"] and whole["sharded"]
        assert meta["checkpointing"] and whole["checkpointing"]
        assert meta["tied"] == whole["tied"] == (kind != "untied")
        # Bit-equal throughout: both builds load the same checkpoint on the same ranks and take
        # the same step on the same batch, same shapes: the same kernels in the same order.
        for key in ("weights", "buffers", "stepped"):
            assert meta[key].keys() == whole[key].keys(), key
            for name, value in whole[key].items():
                assert meta[key][name].dtype == value.dtype, name
                torch.testing.assert_close(
                    torch.from_numpy(meta[key][name]), torch.from_numpy(value), rtol=0, atol=0
                )
        assert meta["metrics"]["actor/loss"] == whole["metrics"]["actor/loss"]
        assert meta["metrics"]["actor/grad_norm"] == whole["metrics"]["actor/grad_norm"]
    # The checkpoint's values, not an initialisation: compare with the file itself.
    reference = build_hf_model(checkpoints[kind], "sdpa", seed=0)
    for name, value in reference.state_dict().items():
        if name in got["meta"]["weights"]:
            assert torch.equal(torch.from_numpy(got["meta"]["weights"][name]), value), name


def _bf16_step(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(config(**CFG, param_dtype=dtype), model_dir, mesh)
        batch = make_batch(4, [5, 9, 3, 12, 7], with_old=True)
        logprobs = trainer.compute_logprobs(batch)
        metrics = trainer.train_step(batch)
        trainer.compute_logprobs(batch)  # a forward without a backward leaves the shards
        params = list(trainer.model.parameters())
        out[dtype] = {
            "logprobs": [t.numpy().copy() for t in logprobs],
            "metrics": metrics,
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "sharded": all(isinstance(p, DTensor) for p in params),
            "dtype": str(trainer.param_dtype),
        }
    return out


def test_bf16_params_train_step_is_close_to_fp32_and_masters_stay_fp32(
    checkpoints: dict[str, str],
) -> None:
    (got, _) = run_ranks(_bf16_step, 2, args=(checkpoints["untied"],), timeout_s=240)
    fp32, bf16 = got["float32"], got["bfloat16"]
    assert bf16["dtype"] == "torch.bfloat16"
    assert fp32["param_dtypes"] == bf16["param_dtypes"] == ["torch.float32"]
    assert fp32["sharded"] and bf16["sharded"]
    diffs = [abs(a - b).max() for a, b in zip(fp32["logprobs"], bf16["logprobs"], strict=True)]
    assert 0 < max(diffs) < 5e-2  # bf16 compute is in effect, and within bf16's error
    for key in ("actor/pg_loss", "actor/entropy", "actor/loss"):
        assert bf16["metrics"][key] == pytest.approx(fp32["metrics"][key], rel=2e-2, abs=2e-3)
    assert bf16["metrics"]["actor/nonfinite_skipped"] == 0.0
