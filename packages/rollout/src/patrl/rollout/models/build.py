"""Build a rollout model (Llama, Qwen2, Qwen3) from a Hugging Face config."""

from __future__ import annotations

from typing import Any

import torch

from patrl.rollout.layers.attention.backend import AttentionBackend
from patrl.rollout.layers.attention.registry import create_attention_backend
from patrl.rollout.model_config import ModelArch
from patrl.rollout.models.causal_lm import CausalLM
from patrl.tpreshard import ParallelLayout, single_process_layout


def build_model(
    config: Any,
    layout: ParallelLayout | None = None,
    *,
    attention: str | AttentionBackend = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> CausalLM:
    """An unloaded model (parameters uninitialised) for an HF config or a `ModelArch`."""
    model_config = config if isinstance(config, ModelArch) else ModelArch.from_hf(config)
    backend = (
        attention
        if isinstance(attention, AttentionBackend)
        else create_attention_backend(attention)
    )
    return CausalLM(
        model_config, layout or single_process_layout(), backend, dtype=dtype, device=device
    )
