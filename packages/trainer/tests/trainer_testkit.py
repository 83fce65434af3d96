"""Helpers for the trainer tests: the kit's tiny configs at this vocab, deterministic batches."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from patrl.trainer import PolicyBatch, Trainer, TrainerConfig
from patrl.trainer.model import build_hf_model, parallelize
from patrl_testkit.models import tiny_config

VOCAB = 128
# The kit's plain Llama and Qwen2 at VOCAB, one with its own lm_head and one tied.
LLAMA: dict[str, Any] = {"vocab_size": VOCAB, "tie_word_embeddings": False}
QWEN2_TIED: dict[str, Any] = {"vocab_size": VOCAB, "tie_word_embeddings": True}


def tiny_llama() -> PretrainedConfig:
    return tiny_config("llama", "plain", **LLAMA)


def tiny_qwen2_tied() -> PretrainedConfig:
    return tiny_config("qwen2", "plain", **QWEN2_TIED)


def make_batch(
    seed: int,
    response_lengths: list[int],
    prompt_len: int = 4,
    with_old: bool = False,
) -> PolicyBatch:
    """Random prompts/responses with +-1 group-normalised-looking advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist() for _ in response_lengths
    ]
    responses = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in response_lengths]
    adv = (torch.randn(len(response_lengths), generator=g)).tolist()
    old = None
    if with_old:
        old = [(-5.0 + 0.3 * torch.randn(n, generator=g)).tolist() for n in response_lengths]
    return PolicyBatch.from_responses(prompts, responses, adv, old_logprobs=old)


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in trainer.iter_full_weights(1 << 30) for n, t in b}


def full_optimizer_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """AdamW's state as full tensors, keyed `<parameter>.<exp_avg|exp_avg_sq|step>` (a
    collective under FSDP: every rank calls it)."""
    _, optim = get_state_dict(trainer.model, trainer.optimizer)
    out = {}
    for name, state in optim["state"].items():
        for key, value in state.items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{name}.{key}"] = full.detach().clone()
    return out


def config(**overrides: object) -> TrainerConfig:
    """Test settings. AdamW's first step is g / (|g| + eps): with the default eps=1e-8, fp32
    round-off (~1e-10) on a near-zero gradient moves a weight by up to lr, so runs that sum the
    same gradient in a different order (micro-batches, ranks) would differ by far more than
    their true error. eps=1e-6 keeps that amplification below 1e-7 at lr=1e-3."""
    base: dict[str, object] = {
        "optim": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01},
        "grad_clip": 1.0,
    }
    base.update(overrides)
    return TrainerConfig.model_validate(base)


def whole_model_build(
    path: Any,
    attn_implementation: str,
    mesh: Any,
    device: torch.device,
    param_dtype: torch.dtype,
    activation_checkpointing: bool,
    head: Any = "lm",
    seed: int = 0,
) -> Any:
    """`model.build_sharded`'s slow twin (patch it in): every rank builds the whole model from
    the checkpoint, then shards it."""
    model = build_hf_model(path, attn_implementation, seed=seed, head=head).to(device)
    return parallelize(model, mesh, param_dtype, activation_checkpointing)
