"""The decoder-only transformer behind Llama, Qwen2 and Qwen3, in tensor-parallel layers.

Parameter names follow Hugging Face's (`model.layers.0.self_attn.o_proj.weight`), except the
fused `qkv_proj` and `gate_up_proj`, which `packed_modules_mapping` maps back to their parts.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from patrl.rollout.layers.activation import SiluAndMul
from patrl.rollout.layers.attention.backend import AttentionBackend
from patrl.rollout.layers.attention.context import AttentionContext
from patrl.rollout.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from patrl.rollout.layers.layernorm import RMSNorm
from patrl.rollout.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from patrl.rollout.layers.rotary import RotaryEmbedding
from patrl.rollout.model_config import ModelArch
from patrl.tpreshard import ParallelLayout

Device = torch.device | str | None


class SelfAttention(nn.Module):
    def __init__(
        self,
        config: ModelArch,
        layer_idx: int,
        layout: ParallelLayout,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: Device,
    ) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.backend = backend
        self.rotary = rotary
        self.qkv_proj = QKVParallelLinear(
            c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, layout,
            bias=c.qkv_bias, dtype=dtype, device=device,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            c.num_heads * c.head_dim,
            c.hidden_size,
            layout,
            bias=c.o_bias,
            dtype=dtype,
            device=device,
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, layout, dtype=dtype, device=device)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, layout, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(ctx.positions, q, k)
        out = self.backend.forward(q, k, v, self.layer_idx, ctx)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(
        self, config: ModelArch, layout: ParallelLayout, dtype: torch.dtype, device: Device
    ) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, {"gate": inter, "up": inter}, layout, dtype=dtype, device=device
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, layout, dtype=dtype, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelArch,
        layer_idx: int,
        layout: ParallelLayout,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: Device,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, layout, dtype=dtype, device=device)
        self.self_attn = SelfAttention(config, layer_idx, layout, backend, rotary, dtype, device)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, eps, layout, dtype=dtype, device=device
        )
        self.mlp = MLP(config, layout, dtype, device)

    def forward(self, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelArch,
        layout: ParallelLayout,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: Device,
    ) -> None:
        super().__init__()
        c = config
        self.embed_tokens = VocabParallelEmbedding(
            c.vocab_size, c.hidden_size, layout, dtype=dtype, device=device
        )
        # One rotary module shared by every layer: its frequencies are a property of the model.
        rotary = RotaryEmbedding(c.head_dim, c.rope, c.max_position_embeddings, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, layout, backend, rotary, dtype, device) for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, layout, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, ctx)
        return self.norm(h)


class CausalLM(nn.Module):
    """Flattened varlen batch of new tokens in, hidden states out; logits on request."""

    # checkpoint module name -> (our fused module, part), for the loader
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(
        self,
        config: ModelArch,
        layout: ParallelLayout,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype = torch.float32,
        device: Device = None,
    ) -> None:
        super().__init__()
        config.check_tp(layout.tp_size)
        self.config = config
        self.layout = layout
        self.backend = backend  # every layer's, asked what a step should stage
        self.model = DecoderModel(config, layout, backend, dtype, device)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, layout, dtype=dtype, device=device
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids [T] (all sequences' new tokens, concatenated) -> hidden [T, hidden]."""
        return self.model(input_ids, ctx)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> full-vocabulary logits [N, vocab], identical on all TP ranks."""
        return self.lm_head(hidden)
