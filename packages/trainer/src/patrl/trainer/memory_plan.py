"""Whether to checkpoint activations: only when the step's memory would not fit otherwise.

`enable_gradient_checkpointing="auto"` decides once per run: off on CPU (host memory is not
the device's budget, and recomputation only costs time); on CUDA, on when the estimate of one
full micro-batch's saved activations plus this rank's weights, gradients and AdamW state
exceeds `HEADROOM` of the device's free memory at build time. With LoRA the base is frozen in
`param_dtype` and only the adapters (bounded as if every linear layer had one) carry fp32
masters, gradients and AdamW state. The estimate is coarse (a
decoder layer saves about 10 hidden-wide and 4 MLP-wide values per token; the logits one
param-dtype and one fp32 vocab row per token), on purpose erring large.
"""

from __future__ import annotations

from typing import Literal

import torch
from transformers import PretrainedConfig

HEADROOM = 0.8
Setting = bool | Literal["auto"]


def step_memory_bytes(
    config: PretrainedConfig,
    tokens: int,
    param_dtype: torch.dtype,
    world_size: int,
    lora_rank: int = 0,
) -> int:
    """Estimated peak bytes of one rank's training step without activation checkpointing:
    `tokens` (one micro-batch) of saved activations and logits, plus this rank's 1/`world_size`
    shard of the weights: fp32 masters, gradients and AdamW's two moments (16 bytes a weight);
    with `lora_rank` > 0, the frozen base in `param_dtype` and 16 bytes an adapter weight."""
    h = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", 4 * h))
    layers = int(config.num_hidden_layers)
    vocab = int(config.vocab_size)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    kv_width = kv * (h // heads)
    per_layer = 2 * h * h + 2 * h * kv_width + 3 * h * inter
    params = layers * per_layer + vocab * h * (1 if config.tie_word_embeddings else 2)
    width = torch.finfo(param_dtype).bits // 8
    activations = tokens * (layers * (10 * h + 4 * inter) * width + vocab * (width + 4))
    if lora_rank > 0:
        # A rank-r adapter on a linear of in x out adds r x (in + out) weights; every linear of
        # a layer: q, o (h -> h), k, v (h -> kv_width), gate, up (h -> inter), down (inter -> h).
        adapters = layers * lora_rank * (4 * h + 2 * (h + kv_width) + 3 * (h + inter))
        held = params * width + 16 * adapters
    else:
        held = 16 * params
    return activations + held // max(world_size, 1)


def use_checkpointing(setting: Setting, device: torch.device, estimate_bytes: int) -> bool:
    """The run's choice: `setting` if a bool; for "auto", off unless on CUDA the estimate
    exceeds HEADROOM of the free device memory."""
    if setting is True or setting is False:
        return setting
    if setting != "auto":
        raise ValueError(
            f"enable_gradient_checkpointing must be true, false or 'auto', got {setting!r}"
        )
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return estimate_bytes > HEADROOM * free
