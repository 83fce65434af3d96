"""LoRA on a rollout model: which layers carry adapters, the adapters' names, merge / unmerge.

The adapters live in the TP linear layers (linear.py). A Hugging Face module name maps onto
the engine's fused layers as the base weights do (`q_proj` -> `qkv_proj` part `q`), so an
adapter tensor `<module>.lora_A.weight` (the trainer's name, or PEFT's with its
`base_model.model.` prefix) loads through the same `load_weights` as the base.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
from torch import nn

from patrl.rollout.layers.linear import ColumnParallelLinear, RowParallelLinear

PEFT_PREFIX = "base_model.model."
ADAPTER_SUFFIXES = {".lora_A.weight": ".lora_A", ".lora_B.weight": ".lora_B"}
# The Hugging Face projections the engine can adapt (the decoder's linear layers).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LoraLinear = ColumnParallelLinear | RowParallelLinear


def enable_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    targets: Collection[str],
    packed: dict[str, tuple[str, str]],
) -> int:
    """Give every decoder linear layer that holds one of `targets` (HF projection names,
    `LORA_TARGETS`) adapters of `rank`, scale `alpha / rank`; a fused layer gets them for all
    its parts (the untargeted parts' B stays zero). `packed` is the model's
    `packed_modules_mapping`. Returns the number of layers adapted. Raises ValueError naming
    an unknown target."""
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(
            f"LoRA target modules {unknown} are not linear layers the engine adapts; "
            f"accepted: {list(LORA_TARGETS)}"
        )
    modules = {packed[t][0] if t in packed else t for t in targets}
    count = 0
    for name, m in model.named_modules():
        if isinstance(m, _LoraLinear) and name.rsplit(".", 1)[-1] in modules:
            m.enable_lora(rank, alpha / rank)
            count += 1
    return count


def lora_layers(model: nn.Module) -> Iterator[_LoraLinear]:
    for m in model.modules():
        if isinstance(m, _LoraLinear) and m.lora_A is not None:
            yield m


def has_lora(model: nn.Module) -> bool:
    return next(lora_layers(model), None) is not None


def is_merged(model: nn.Module) -> bool:
    return any(m.lora_saved is not None for m in lora_layers(model))


def merge_lora(model: nn.Module) -> None:
    """Merged mode: fold every adapter into its weight (the forward then has no LoRA cost).
    The engine merges before it captures CUDA graphs (`EngineConfig.lora_merged`) and
    `load_weights` restores the mode it found, so captured graphs match the mode; merging a
    live engine by hand would leave graphs that still add the adapters."""
    for m in lora_layers(model):
        m.merge_lora()


def saved_base_weights(model: nn.Module) -> list[torch.Tensor]:
    """The base weights merged mode keeps beside the merged ones (for an exact unmerge): with
    the parameters, weight memory the engine holds (and moves to the host at `sleep(2)`)."""
    return [m.lora_saved for m in lora_layers(model) if m.lora_saved is not None]


def unmerge_lora(model: nn.Module) -> None:
    """Back to the adapter path: each weight as it was before `merge_lora`, bit for bit."""
    for m in lora_layers(model):
        m.unmerge_lora()


def adapter_param_name(hf_name: str) -> str | None:
    """`...q_proj.lora_A.weight` (PEFT's prefix optional) -> `...q_proj.lora_A`; None for a
    name that is not an adapter's."""
    name = hf_name.removeprefix(PEFT_PREFIX)
    for suffix, param in ADAPTER_SUFFIXES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix) + param
    return None


def is_adapter_key(key: str) -> bool:
    """Whether a `weight_keys` key is an adapter's (`...lora_A`, `...lora_B:q`)."""
    name = key.split(":")[0]
    return name.endswith((".lora_A", ".lora_B"))
