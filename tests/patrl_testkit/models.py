"""Tiny random Hugging Face models, one per family, for tests and benchmarks.

Two flavours. "full" turns on what each family's loader must get right (Llama: GQA + llama3
rope scaling; Qwen2: qkv bias + tied embeddings; Qwen3: q/k norm, a head_dim that is not
hidden / heads, biases everywhere), uses eager attention for HF reference logits, and
randomises biases and norms. "plain" is the shared sizes with HF's defaults for the rest.
Keyword overrides win over both, so a test can reproduce any config it depends on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

# transformers is imported inside the functions that need it: spawned ranks import this
# module and should not pay seconds for modelling code they never run.

Flavour = Literal["full", "plain"]
FAMILIES = ("llama", "qwen2", "qwen3")
SIZES: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
FULL: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 250, "rope_scaling": LLAMA3_ROPE},
    "qwen2": {"vocab_size": 256, "tie_word_embeddings": True},
    # o_proj's bias exercises the row-parallel bias.
    "qwen3": {"vocab_size": 200, "head_dim": 32, "attention_bias": True},
}


def tiny_config(family: str, flavour: Flavour = "full", **overrides: Any) -> Any:
    """The HF config of `family` ("llama", "qwen2", "qwen3") in `flavour`, then `overrides`."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if family not in classes:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if flavour == "full":
        base = {**SIZES, "attn_implementation": "eager", **FULL[family]}
    elif flavour == "plain":
        base = dict(SIZES)
    else:
        raise ValueError(f"flavour must be 'full' or 'plain', got {flavour!r}")
    return classes[family](**{**base, **overrides})


def tiny_hf_model(family: str, seed: int = 0, flavour: Flavour = "full", **overrides: Any) -> Any:
    """An HF causal LM of `tiny_config(...)` in eval mode, initialised after manual_seed(seed).

    "full" then randomises every bias and norm weight (HF sets them to 0 and 1), so a loader
    that drops or misplaces one changes the logits.
    """
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    classes = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}
    torch.manual_seed(seed)
    model = classes[family](tiny_config(family, flavour, **overrides)).eval()
    if flavour == "full":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf_model(model: Any, path: Path, tokenizer: Any = None, **kwargs: Any) -> Path:
    """Save `model` as safetensors to `path` (with `tokenizer` beside it when given) -> path.
    `kwargs` go to `save_pretrained` (e.g. max_shard_size)."""
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def save_tiny_model(
    path: Path,
    family: str = "llama",
    flavour: Flavour = "full",
    *,
    seed: int = 0,
    tokenizer: Any = None,
    **overrides: Any,
) -> Path:
    """`tiny_hf_model(family, seed, flavour, **overrides)` saved to `path` -> path; with a
    `tokenizer`, saved beside the model, and vocab_size defaults to len(tokenizer)."""
    if tokenizer is not None:
        overrides.setdefault("vocab_size", len(tokenizer))
    model = tiny_hf_model(family, seed, flavour, **overrides)
    return save_hf_model(model, path, tokenizer)


def save_tiny_reward_model(
    path: Path, tokenizer: Any, *, seed: int = 0, num_labels: int = 1, **overrides: Any
) -> Path:
    """A plain tiny Llama sequence classifier (`num_labels` scores, a random score head after
    manual_seed(seed)) saved with `tokenizer` to `path` -> path."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    overrides.setdefault("pad_token_id", tokenizer.pad_token_id)
    config = tiny_config(
        "llama", "plain", vocab_size=len(tokenizer), num_labels=num_labels, **overrides
    )
    return save_hf_model(LlamaForSequenceClassification(config).eval(), path, tokenizer)
