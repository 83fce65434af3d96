"""Attention backends by name. `flash` is imported only when it is selected."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from patrl.rollout.layers.attention.backend import AttentionBackend


def _sdpa() -> AttentionBackend:
    from patrl.rollout.layers.attention.sdpa import SdpaBackend

    return SdpaBackend()


def _flash() -> AttentionBackend:
    from patrl.rollout.layers.attention.flash import FlashBackend

    return FlashBackend()


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"sdpa": _sdpa, "flash": _flash}


def attention_backend_names() -> list[str]:
    """Names accepted by `create_attention_backend` (plus "auto")."""
    return [*_BACKENDS, "auto"]


def register_attention_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    if name in _BACKENDS or name == "auto":
        raise ValueError(f"attention backend {name!r} is already registered")
    _BACKENDS[name] = factory


def resolve_attention_backend(name: str) -> str:
    """ "auto" -> "flash" when CUDA and flash_attn are both present, else "sdpa"."""
    if name == "auto":
        has_flash = importlib.util.find_spec("flash_attn") is not None
        return "flash" if torch.cuda.is_available() and has_flash else "sdpa"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {attention_backend_names()}"
        )
    return name


def create_attention_backend(name: str = "auto") -> AttentionBackend:
    return _BACKENDS[resolve_attention_backend(name)]()
