"""Rotary position embedding in Hugging Face's rotate-half convention.

cos/sin are computed on the fly from the positions in fp32 exactly as transformers does
(`positions.float() * inv_freq`), then cast to the activations' dtype, so our q/k match HF's bit
for bit. Supported `rope_type`s: default, linear, llama3 (Llama 3.1+), yarn (Qwen long context).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rope: Mapping[str, Any],
        max_position_embeddings: int,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(head_dim, rope, max_position_embeddings)
        # A plain attribute, not a buffer: module.to(bf16) must never round the frequencies.
        self.inv_freq = inv_freq.to(device)
        # Every layer of one forward passes the same positions tensor: compute cos/sin once.
        self._cached: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] by the angles of `positions` [T]."""
        cos, sin = self._cos_sin(positions, q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def _cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._cached
        if c is not None and c[0] is positions and c[1] == dtype:
            return c[2], c[3]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None, :]
        self._cached = (positions, dtype, cos, sin)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_frequencies(
    head_dim: int, rope: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention scaling) for a HF `rope_parameters` dict."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported; only 1.0"
        )
    base = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        return inv_freq / rope["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, rope, max_position_embeddings), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, base, rope, max_position_embeddings)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, rope: Mapping[str, Any], max_pos: int) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope.get("original_max_position_embeddings", max_pos)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    dim: int, base: float, rope: Mapping[str, Any], max_pos: int
) -> tuple[torch.Tensor, float]:
    old_len = rope.get("original_max_position_embeddings", max_pos)
    factor = rope.get("factor") or max_pos / old_len
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
