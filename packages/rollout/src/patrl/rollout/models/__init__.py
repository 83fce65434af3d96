"""Rollout model families (Llama, Qwen2/2.5, Qwen3), built from a Hugging Face config."""

from patrl.rollout.models.build import build_model
from patrl.rollout.models.causal_lm import CausalLM

__all__ = ["CausalLM", "build_model"]
