"""Peak host memory of a 2-rank trainer build of a ~200M-parameter model: the meta-device build
(each rank reads its own shards) stays under 0.75x the full fp32 model per rank; the
whole-model build (its slow twin) does not, which shows the measurement can tell them apart.

Peak RSS is the kernel's VmHWM, reset just before the build (`/proc/self/clear_refs` = 5) and
compared with VmRSS at that moment, so it counts the mapped safetensors pages too."""

from __future__ import annotations

import contextlib
import gc
import math
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from trainer_testkit import config, whole_model_build
from transformers import Qwen2Config

from patrl.trainer import Trainer
from patrl.trainer.model import build_on_meta
from patrl_testkit.multirank import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

# Qwen2-shaped, ~197M parameters (~790 MB in fp32), untied, a modest vocab.
SHAPE: dict[str, Any] = dict(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
BOUND = 0.75


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """A random fp32 checkpoint of SHAPE in a temporary directory -> (path, its fp32 bytes)."""
    path = tmp_path_factory.mktemp("rss_model")
    cfg = Qwen2Config(**SHAPE)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(p.shape, generator=g) * 0.02
        for name, p in build_on_meta(cfg, "sdpa").state_dict().items()
    }
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path), nbytes


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _peak_build_bytes(rank: int, world_size: int, model_dir: str, whole: bool) -> int:
    """Peak RSS growth of this rank while it builds the trainer, in bytes."""
    mesh = init_device_mesh("cpu", (world_size,))
    patch = mock.patch("patrl.trainer.trainer.build_sharded", whole_model_build)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    baseline = _kib("VmRSS")
    with patch if whole else contextlib.nullcontext():
        trainer = Trainer(config(), model_dir, mesh)
    peak = _kib("VmHWM")
    assert sum(p.to_local().numel() for p in trainer.model.parameters()) > 0
    return (peak - baseline) * 1024


def _clear_refs_works() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _clear_refs_works(), reason="needs /proc/self/clear_refs (Linux)")
def test_meta_build_peak_rss_per_rank_is_under_three_quarters_of_the_model(
    big_checkpoint: tuple[str, int],
) -> None:
    model_dir, model_bytes = big_checkpoint
    assert 180e6 < model_bytes / 4 < 220e6
    meta = run_ranks(_peak_build_bytes, 2, args=(model_dir, False), timeout_s=120)
    whole = run_ranks(_peak_build_bytes, 2, args=(model_dir, True), timeout_s=120)
    print(
        f"peak RSS growth per rank, MB: meta {[round(b / 1e6) for b in meta]}, "
        f"whole {[round(b / 1e6) for b in whole]}; model {model_bytes / 1e6:.0f} MB"
    )
    assert max(meta) < BOUND * model_bytes
    assert min(whole) > BOUND * model_bytes
    # Each rank holds at least its half of the fp32 model.
    assert min(meta) > math.floor(model_bytes / 2) * 0.95
