"""The architecture facts the rollout models need, read from a Hugging Face config.

The three supported families are one decoder-only transformer that differs in a few flags:
Llama (optional attention bias on q, k, v and o), Qwen2/2.5 (bias on q, k, v only), Qwen3
(q/k RMSNorm per head, optional attention bias). Everything else in the HF config that would
change the math (another activation, sliding windows, MLP bias, partial rotary) is rejected
here with the key and value, rather than silently computed wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from patrl.rollout.layers.rotary import SUPPORTED_ROPE_TYPES

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class ModelArch:
    """One model's architecture as the engine builds it (`from_hf`); the orchestrator's
    `ModelConfig` is the job's `model:` section (where the model is), a different thing."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, hf: Any) -> ModelArch:
        """Translate a transformers config (LlamaConfig, Qwen2Config, Qwen3Config, ...)."""
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{list(SUPPORTED_MODEL_TYPES)}"
            )
        _reject_unsupported(hf)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        heads = hf.num_attention_heads
        config = cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            rope=_rope_parameters(hf),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            qk_norm=model_type == "qwen3",
        )
        config.check()
        return config

    def check(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        rope_type = self.rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )

    def check_tp(self, tp_size: int) -> None:
        """Raise unless this model can be split over `tp_size` ranks."""
        if self.num_heads % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide num_attention_heads={self.num_heads}")
        kv = self.num_kv_heads
        if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
            raise ValueError(
                f"tp_size={tp_size} and num_key_value_heads={kv}: one must divide the other"
            )
        if self.intermediate_size % tp_size:
            raise ValueError(
                f"tp_size={tp_size} must divide intermediate_size={self.intermediate_size}"
            )


def _rope_parameters(hf: Any) -> dict[str, Any]:
    # transformers >= 5 keeps everything in `rope_parameters`; 4.x has rope_scaling + rope_theta.
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def _reject_unsupported(hf: Any) -> None:
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; only 'silu'")
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported; only False")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported; only full attention")
    kinds = set(getattr(hf, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"layer_types {sorted(kinds)} are not supported; only 'full_attention'")
