"""The demo policy: a tiny Llama, small enough to train and sample on two CPU cores."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


class DemoModelConfig(BaseModel):
    """Shape of the demo model. Part of the cache key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(128, gt=0)
    intermediate_size: int = Field(384, gt=0)
    num_hidden_layers: int = Field(3, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    max_position_embeddings: int = Field(512, gt=0)
    tie_word_embeddings: bool = False


def build_demo_model(
    config: DemoModelConfig, tokenizer: PreTrainedTokenizerBase
) -> LlamaForCausalLM:
    """A freshly initialised model whose special ids match the tokenizer's."""
    hf_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(hf_config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model
