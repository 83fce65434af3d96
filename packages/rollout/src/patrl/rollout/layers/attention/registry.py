"""Attention backends by name, and the KV block sizes each accepts (the one place for both).

`flash` and `triton` are imported only when selected (CPU machines may lack their packages).
"auto" picks flash, then triton, then sdpa; see docs/attention.md.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from patrl.rollout.layers.attention.backend import AttentionBackend


@dataclass(frozen=True, slots=True)
class BlockSizeRule:
    """The KV block sizes a backend takes: multiples of `multiple_of`; `default` when unset."""

    default: int
    multiple_of: int = 1
    why: str = ""

    def accepts(self, block_size: int) -> bool:
        return block_size > 0 and block_size % self.multiple_of == 0


def _sdpa() -> AttentionBackend:
    from patrl.rollout.layers.attention.sdpa import SdpaBackend

    return SdpaBackend()


def _triton() -> AttentionBackend:
    from patrl.rollout.layers.attention.triton_backend import TritonBackend

    return TritonBackend()


def _flash() -> AttentionBackend:
    from patrl.rollout.layers.attention.flash import FlashBackend

    return FlashBackend()


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "sdpa": _sdpa,
    "flash": _flash,
    "triton": _triton,
}
_BLOCK_SIZES: dict[str, BlockSizeRule] = {
    "sdpa": BlockSizeRule(16),
    "flash": BlockSizeRule(256, 256, "flash-attn's paged KV needs a multiple of 256"),
    "triton": BlockSizeRule(16),
}


def attention_backend_names() -> list[str]:
    """Names accepted by `create_attention_backend` (plus "auto")."""
    return [*_BACKENDS, "auto"]


def register_attention_backend(
    name: str, factory: Callable[[], AttentionBackend], block_sizes: BlockSizeRule | None = None
) -> None:
    """Add a backend; `block_sizes` defaults to any size, 16 when unset."""
    if name in _BACKENDS or name == "auto":
        raise ValueError(f"attention backend {name!r} is already registered")
    _BACKENDS[name] = factory
    _BLOCK_SIZES[name] = block_sizes or BlockSizeRule(16)


def resolve_attention_backend(
    name: str, block_size: int | None = None, *, cuda: bool | None = None
) -> str:
    """A registered backend's name for `name`: "auto" -> "flash" on CUDA with flash_attn
    importable and `block_size` (None = unset) one it takes, else "triton" on CUDA with triton
    importable, else "sdpa". `cuda`: whether the engine runs on CUDA (None = CUDA available)."""
    if name != "auto":
        if name not in _BACKENDS:
            raise ValueError(
                f"unknown attention backend {name!r}; choose one of {attention_backend_names()}"
            )
        return name
    on_cuda = torch.cuda.is_available() if cuda is None else cuda
    fits_flash = block_size is None or _BLOCK_SIZES["flash"].accepts(block_size)
    if on_cuda and fits_flash and _importable("flash_attn"):
        return "flash"
    if on_cuda and _importable("triton"):
        return "triton"
    return "sdpa"


def resolve_block_size(backend: str, block_size: int | None) -> int:
    """`block_size`, checked against `backend` (a registered name, not "auto"); None = the
    backend's default. An incompatible pair raises, naming both and what is accepted."""
    rule = _BLOCK_SIZES[backend]
    if block_size is None:
        return rule.default
    if not rule.accepts(block_size):
        others = [n for n, r in _BLOCK_SIZES.items() if r.accepts(block_size)]
        reason = f"{rule.why}; " if rule.why else ""
        raise ValueError(
            f"attention_backend={backend!r} cannot use block_size={block_size}: it takes a "
            f"positive multiple of {rule.multiple_of} ({reason}its default is {rule.default}). "
            "Leave block_size unset for the backend's default, or pick a backend that takes "
            f"{block_size}: {others}"
        )
    return block_size


def create_attention_backend(name: str = "auto") -> AttentionBackend:
    return _BACKENDS[resolve_attention_backend(name)]()


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
