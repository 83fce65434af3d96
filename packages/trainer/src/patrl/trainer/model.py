"""Build the policy and apply FSDP2 to it, in torchtitan's order.

Order: build (every rank the same weights) -> activation checkpointing -> `fully_shard` each
decoder layer -> `fully_shard` the root. The model stays a plain Hugging Face
`PreTrainedModel`: parameter names are the checkpoint's names, so weight export needs no
renaming. Each rank materialises the full model once before sharding: loading stays a plain
`from_pretrained`, at the price of one full copy per rank while building. See docs/training.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

ModelSource = str | os.PathLike[str] | PretrainedConfig


def build_model(source: ModelSource, attn_implementation: str, seed: int) -> PreTrainedModel:
    """An fp32 causal LM from a local HF directory, or randomly initialised from a config.

    Random init is seeded so that every rank builds the identical model (FSDP shards each
    rank's own copy; they must agree).
    """
    if isinstance(source, PretrainedConfig):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(
                source, dtype=torch.float32, attn_implementation=attn_implementation
            )
    else:
        path = Path(source)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model directory {str(path)!r} has no config.json; pass a local Hugging Face "
                "model directory or a transformers config"
            )
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation
        )
    model.config.use_cache = False
    return model


def decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The repeated blocks, found by the class names HF lists in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} lists no decoder layer class in _no_split_modules "
            f"({sorted(names)}); cannot shard it per layer"
        )
    return layers


def parallelize(
    model: PreTrainedModel,
    mesh: DeviceMesh | None,
    param_dtype: torch.dtype,
    activation_checkpointing: bool,
) -> PreTrainedModel:
    """Activation checkpointing, then FSDP2 per decoder layer and on the root (if a mesh)."""
    if activation_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if mesh is None:
        return model
    if mesh.ndim != 1:
        raise ValueError(f"the trainer shards over a 1-D mesh, got {mesh.ndim}-D {mesh}")
    # Gradients are reduced in fp32 whatever the compute dtype.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def freeze(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
