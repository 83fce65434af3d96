"""shard_loader on a single process: a meta-built model filled by `load_shards` equals
`from_pretrained`, and a checkpoint that does not fit the model is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig, PreTrainedModel

from patrl.trainer.model import build_hf_model, build_on_meta, materialize
from patrl.trainer.shard_loader import checkpoint_index, load_shards
from patrl_testkit.models import save_hf_model, tiny_config, tiny_hf_model


def _materialised(config: PretrainedConfig) -> PreTrainedModel:
    model = build_on_meta(config, "sdpa")
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    materialize(model, torch.device("cpu"))
    return model


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_unsharded_load_equals_from_pretrained(tmp_path: Path, family: str) -> None:
    path = save_hf_model(tiny_hf_model(family, seed=4).bfloat16(), tmp_path)
    want = build_hf_model(path, "sdpa", seed=0)
    model = _materialised(want.config)
    load_shards(model, path)
    assert model.state_dict().keys() == want.state_dict().keys()
    for name, value in want.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    for (name, buf), (_, ref) in zip(model.named_buffers(), want.named_buffers(), strict=True):
        assert torch.equal(buf, ref), name
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == (family == "qwen2")


def test_a_checkpoint_of_another_shape_is_refused_by_name(tmp_path: Path) -> None:
    path = save_hf_model(tiny_hf_model("llama", vocab_size=250), tmp_path)
    model = _materialised(tiny_config("llama", vocab_size=251))
    with pytest.raises(
        ValueError, match=r"'model\.embed_tokens\.weight'.*\(250, 64\).*\(251, 64\)"
    ):
        load_shards(model, path)


def test_a_missing_tensor_is_refused_by_name(tmp_path: Path) -> None:
    model = tiny_hf_model("llama")
    model.config.save_pretrained(tmp_path)
    kept = {n: t for n, t in model.state_dict().items() if n != "model.norm.weight"}
    save_file(kept, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        load_shards(_materialised(model.config), tmp_path)


def test_a_directory_without_safetensors_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        checkpoint_index(tmp_path)
