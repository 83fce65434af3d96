"""The trainer on CUDA over an NCCL group (one rank per GPU, at most 2): the meta-device build
loads the checkpoint's exact weights, and a bf16 mixed-precision step keeps fp32 masters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from trainer_testkit import VOCAB, config, full_weights, make_batch
from transformers import AutoModelForCausalLM

from patrl.trainer import Trainer
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]


def _world() -> int:
    return max(1, min(torch.cuda.device_count(), 2))


def _nccl_mesh(rank: int) -> DeviceMesh:
    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")
    return DeviceMesh.from_group(group, "cuda")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu_trainer")
    qwen2 = tiny_hf_model("qwen2", seed=1, vocab_size=VOCAB + 1)  # tied, uneven vocab split
    llama = tiny_hf_model("llama", seed=2, vocab_size=VOCAB + 1).bfloat16()
    return {
        "tied_fp32": str(save_hf_model(qwen2, root / "tied")),
        "untied_bf16": str(save_hf_model(llama, root / "untied")),
    }


def _meta_build(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    trainer = Trainer(config(), model_dir, mesh=_nccl_mesh(rank))
    model = trainer.model
    return {
        "device": {str(p.device) for p in model.parameters()},
        "weights": {n: t.cpu().numpy() for n, t in full_weights(trainer).items()},
        "buffers": {n: b.cpu().numpy() for n, b in model.named_buffers()},
        "tied": model.lm_head.weight is model.get_input_embeddings().weight,
    }


@pytest.mark.parametrize("kind", ["tied_fp32", "untied_bf16"])
def test_meta_build_on_cuda_equals_from_pretrained(checkpoints: dict[str, str], kind: str) -> None:
    model_dir = checkpoints[kind]
    want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for rank, got in enumerate(run_ranks(_meta_build, _world(), args=(model_dir,))):
        assert got["device"] == {f"cuda:{rank}"}
        assert got["tied"] == (kind == "tied_fp32")
        for name, value in want.state_dict().items():
            if name in got["weights"]:
                assert torch.equal(torch.from_numpy(got["weights"][name]), value), name
        assert got["weights"].keys() <= want.state_dict().keys()
        for name, value in want.named_buffers():
            assert torch.equal(torch.from_numpy(got["buffers"][name]), value), name


def _bf16_steps(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    trainer = Trainer(config(param_dtype="auto"), model_dir, mesh=_nccl_mesh(rank))
    before = full_weights(trainer)
    batch = make_batch(0, [5, 9, 3, 12, 7], with_old=True)
    metrics = [trainer.train_step(batch) for _ in range(2)]
    logprobs = trainer.compute_logprobs(batch)  # gathered over the NCCL group's object path
    after = full_weights(trainer)
    return {
        "param_dtype": str(trainer.param_dtype),
        "master_dtypes": {str(p.dtype) for p in trainer.model.parameters()},
        "state_dtypes": {
            str(v.dtype)
            for state in trainer.optimizer.state.values()
            for key, v in state.items()
            if key != "step"
        },
        "metrics": metrics,
        "logprob_devices": {str(t.device) for t in logprobs},
        "moved": max((after[n] - before[n]).abs().max().item() for n in before),
    }


def test_bf16_train_step_on_cuda_keeps_fp32_masters(checkpoints: dict[str, str]) -> None:
    for got in run_ranks(_bf16_steps, _world(), args=(checkpoints["tied_fp32"],)):
        assert got["param_dtype"] == "torch.bfloat16"  # "auto" on CUDA
        assert got["master_dtypes"] == {"torch.float32"}
        assert got["state_dtypes"] == {"torch.float32"}  # AdamW's moments too
        assert got["logprob_devices"] == {"cpu"}
        assert got["moved"] > 0
        for m in got["metrics"]:
            assert m["actor/nonfinite_skipped"] == 0.0
            assert torch.isfinite(torch.tensor(m["actor/loss"]))
            assert m["perf/max_memory_allocated_gb"] > 0
