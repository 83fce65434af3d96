"""Build the policy and apply FSDP2 to it, in torchtitan's order.

From a checkpoint directory over a mesh: build on the meta device -> activation checkpointing
-> `fully_shard` each decoder layer -> `fully_shard` the root -> materialise on the device ->
each rank loads its own shards (shard_loader.py), so no rank holds the full model. Without a
mesh, or from a config (random init), every rank builds the full model first. The model stays
a plain Hugging Face `PreTrainedModel`: parameter names are the checkpoint's names, so weight
export needs no renaming. See docs/training.md.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_parameter_registration_hook
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from patrl.trainer.lora import (
    LoraConfig,
    add_adapters,
    cast_frozen,
    init_adapters,
    is_adapter_name,
    load_adapter,
)
from patrl.trainer.shard_loader import checkpoint_index, load_shards, shard_rows

ModelSource = str | os.PathLike[str] | PretrainedConfig
# "lm": the causal LM (the policy); "value": a token-level value head with one output (critic);
# "score": a sequence classifier as saved (a reward model).
Head = Literal["lm", "value", "score"]
VALUE_HEAD = ("score.weight", "score.bias")


def build_hf_model(
    source: ModelSource, attn_implementation: str, seed: int, head: Head = "lm"
) -> PreTrainedModel:
    """An fp32 model, whole, from a local HF directory or randomly initialised from a config.

    Random init is seeded so that every rank builds the identical model (FSDP shards each
    rank's own copy; they must agree); it costs the full model's memory and init time on every
    rank, which is why directories over a mesh go through `build_sharded` instead. A value
    model whose source has no value head gets a new one (`init_value_head`).
    """
    auto = _auto_class(head)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(source, PretrainedConfig):
            model = auto.from_config(
                with_head(source, head),
                dtype=torch.float32,
                attn_implementation=attn_implementation,
            )
        else:
            path = model_dir(source)
            model = auto.from_pretrained(
                path,
                config=with_head(AutoConfig.from_pretrained(path), head),
                dtype=torch.float32,
                attn_implementation=attn_implementation,
            )
    if head == "value" and not _has_value_head(source):
        init_value_head(model, seed)
    model.config.use_cache = False
    return model


def _auto_class(head: Head) -> Any:
    return {
        "lm": AutoModelForCausalLM,
        "value": AutoModelForTokenClassification,
        "score": AutoModelForSequenceClassification,
    }[head]


def with_head(config: PretrainedConfig, head: Head) -> PretrainedConfig:
    """`config` as the model of `head` needs it: a value model has one label and no dropout
    (dropout would make the values of one forward differ from the next). A reward model
    ("score") keeps its own config."""
    if head != "value":
        return config
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return config


def _has_value_head(source: ModelSource) -> bool:
    if isinstance(source, PretrainedConfig):
        return False
    return VALUE_HEAD[0] in checkpoint_index(model_dir(source))


def init_value_head(model: nn.Module, seed: int, std: float = 0.0) -> None:
    """A new value head, the same on every rank: weight ~ N(0, std) from `seed` (0 by
    default), bias 0. The first values are 0, so the first advantages are the returns."""
    weight = model.get_parameter(VALUE_HEAD[0])
    full = torch.randn(tuple(weight.shape), generator=torch.Generator().manual_seed(seed)) * std
    with torch.no_grad():
        _copy_rows(weight, full)
        if VALUE_HEAD[1] in dict(model.named_parameters()):
            model.get_parameter(VALUE_HEAD[1]).zero_()


def _copy_rows(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        start, stop = shard_rows(target)
        target.to_local().copy_(full[start:stop])
    else:
        target.copy_(full)


def build_sharded(
    source: str | os.PathLike[str],
    attn_implementation: str,
    mesh: DeviceMesh,
    device: torch.device,
    param_dtype: torch.dtype,
    activation_checkpointing: bool,
    head: Head = "lm",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    lora: LoraConfig | None = None,
    base_dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """The model of a local HF directory, its parameters in `dtype` (fp32: the trainer's master
    weights; an inference-only model may keep its compute dtype), FSDP2-sharded over `mesh` on
    `device`. With an enabled `lora`, adapters go on the meta model before sharding (so each
    decoder layer's FSDP unit holds its adapters) and are initialised or loaded after the base;
    `base_dtype` (None: `dtype`) is then the dtype of the frozen base (`cast_frozen`: the
    adapters and a value head stay in `dtype`).

    Each rank reads only its own shards, cast to `dtype` whatever the checkpoint's; buffers
    (rotary `inv_freq`) are computed on the host at construction, as `from_pretrained` does.
    Same weights, bit for bit, as `parallelize(build_hf_model(...))`, without the full copy.
    """
    path = model_dir(source)
    model = build_on_meta(AutoConfig.from_pretrained(path), attn_implementation, head, dtype)
    if lora is not None and lora.enabled:
        add_adapters(model, lora, lora_trainable(head))
        if base_dtype is not None:
            cast_frozen(model, base_dtype)
    model = parallelize(model, mesh, param_dtype, activation_checkpointing)
    materialize(model, device)
    fresh_head = head == "value" and not _has_value_head(path)
    adapters = {n for n, _ in model.named_parameters() if is_adapter_name(n)}
    load_shards(model, path, skip=(*(VALUE_HEAD if fresh_head else ()), *adapters))
    if fresh_head:
        init_value_head(model, seed)
    if adapters:
        start_adapters(model, lora, seed)
    return model


def lora_trainable(head: Head) -> tuple[str, ...]:
    """The modules that train whole beside the adapters: a value model's head (its `score`,
    new or loaded), none of a causal LM."""
    return (VALUE_HEAD[0].rsplit(".", 1)[0],) if head == "value" else ()


def start_adapters(model: nn.Module, lora: LoraConfig | None, seed: int) -> None:
    """Fill the adapters `add_adapters` made: from `lora.lora_adapter_path`, else PEFT's
    init drawn from `seed`."""
    if lora is not None and lora.lora_adapter_path is not None:
        load_adapter(model, lora.lora_adapter_path)
    else:
        init_adapters(model, seed)


def build_on_meta(
    config: PretrainedConfig,
    attn_implementation: str,
    head: Head = "lm",
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """The model of `config` (parameters in `dtype`) with every parameter on the meta device;
    buffers are real host tensors (only parameters are intercepted at registration)."""
    with _parameters_on_meta():
        model = _auto_class(head).from_config(
            with_head(config, head), dtype=dtype, attn_implementation=attn_implementation
        )
    model.config.use_cache = False
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give `model`'s meta parameters uninitialised storage on `device`, in place, keeping the
    values of its buffers and the ties between its parameters (`to_empty` alone loses both)."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    ties = [names for names in _aliases(model).values() if len(names) > 1]
    model.to_empty(device=device)
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            if model.get_parameter(name) is not first:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, first)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each distinct parameter, keyed by the parameter's id."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def model_dir(source: str | os.PathLike[str]) -> Path:
    """`source` as a path, checked to be a local Hugging Face model directory."""
    path = Path(source)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {str(path)!r} has no config.json; pass a local Hugging Face "
            "model directory or a transformers config"
        )
    return path


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    # Unlike `with torch.device("meta")`, buffers computed in __init__ (rotary inv_freq) stay
    # real. A parameter lives on the host only until it is registered; re-registering a meta
    # parameter (tying lm_head to embed_tokens) keeps the very object, so ties survive.
    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    # torch types the hook as returning None; a returned parameter replaces the registered one.
    handle = register_module_parameter_registration_hook(to_meta)  # type: ignore[arg-type]
    try:
        yield
    finally:
        handle.remove()


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
        enable_activation_checkpointing(model)
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


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant: FSDP2 and
    packed rows need it), through `activation_checkpointing_enable` where transformers has it
    (5.23 on) and its older name, `gradient_checkpointing_enable`, before that."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def freeze(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
