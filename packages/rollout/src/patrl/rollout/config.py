"""Engine configuration: validated when it is built, errors name the key and what is allowed."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from patrl.rollout.layers.attention.registry import (
    attention_backend_names,
    resolve_attention_backend,
    resolve_block_size,
)
from patrl.rollout.tp_policy import AdaptiveTP, StaticTP, TPPolicy

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


SpecSource = Literal["group", "history", "prompt"]


class SpeculativeConfig(BaseModel):
    """Speculative decoding with drafts from the prompt's group, its history and the prompt
    itself (patrl.rollout.drafter): each decode step verifies up to `num_speculative_tokens`
    drafted tokens per sequence; the emitted tokens are distributed exactly as without it.
    vLLM's n-gram names where they exist (num_speculative_tokens, prompt_lookup_min/max)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable: bool = Field(False, description="draft and verify in decode steps")
    sources: tuple[SpecSource, ...] = Field(
        ("group", "history", "prompt"),
        min_length=1,
        description="where drafts come from, in order of preference: the prompt's other "
        "samples (in flight or finished), its earlier responses, the prompt",
    )
    num_speculative_tokens: int = Field(
        4, gt=0, le=64, description="the most draft tokens a sequence verifies in one step"
    )
    prompt_lookup_min: int = Field(2, gt=0, description="shortest n-gram a draft matches on")
    prompt_lookup_max: int = Field(4, gt=0, description="longest n-gram a draft matches on")
    adaptive_draft_length: bool = Field(
        True,
        description="each sequence's draft length follows its acceptance: one more after a "
        "whole draft is accepted, one past the accepted ones after a rejection",
    )
    max_num_seqs: int = Field(
        16,
        ge=0,
        description="speculate only in decode steps of at most this many sequences (the "
        "tail: a larger step is compute-bound, where verifying costs more than it saves); "
        "0 = always",
    )
    history_size: int = Field(
        8, ge=0, description="earlier responses kept per prompt for the history source"
    )
    history_prompts: int = Field(4096, gt=0, description="prompts whose history is kept")
    latency_profile: str | None = Field(
        None,
        description="a latency profile (python -m patrl.rollout.profile) that prices each "
        "step: a step drafts only when the tokens its drafts are expected to add beat what "
        "their query tokens cost (so large batches stay off by themselves); None = every "
        "step of at most max_num_seqs sequences drafts",
    )

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        return self


class EngineConfig(BaseModel):
    """One rollout replica (a TP group) and its budgets: vLLM's engine arguments where the
    concept exists (max_num_seqs, max_num_batched_tokens, max_model_len, block_size,
    gpu_memory_utilization, enable_prefix_caching, enforce_eager), checked when built: a bad
    value is an error naming the key and what is accepted. Frozen; derive variants with
    `model_copy(update=...)`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face model directory (config.json + *.safetensors)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights and KV dtype; auto = the checkpoint's, except float32 -> bfloat16 "
        "on CUDA (vLLM's rule: no GPU rollout wants fp32)",
    )
    device: str = Field("auto", description="'auto' (cuda when available, else cpu), 'cpu', 'cuda'")
    attention_backend: str = Field(
        "auto",
        description="'sdpa', 'triton' (CUDA), 'flash' (CUDA + flash-attn) or 'auto' (the first "
        "of flash, triton, sdpa that this machine runs); validation resolves 'auto'",
    )
    block_size: int = Field(
        None,  # type: ignore[assignment]  # _resolve_backend_and_block_size makes it an int
        gt=0,
        description="tokens per KV block; None = the attention backend's (flash 256, else 16)",
    )
    num_kv_blocks: int | None = Field(None, gt=0, description="KV blocks; None = from memory")
    kv_cache_memory_bytes: int | None = Field(
        None,
        gt=0,
        description="KV budget when num_kv_blocks is None; None = from gpu_memory_utilization "
        "on CUDA; on CPU enough for max_num_seqs sequences of max_model_len tokens, at most "
        "512 MiB",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="fraction of the device's total memory this engine may use (weights, "
        "activations and KV, as in vLLM): sizes the KV cache on CUDA when num_kv_blocks and "
        "kv_cache_memory_bytes are None",
    )
    max_num_seqs: int = Field(256, gt=0, description="sequences decoded together at most")
    max_num_batched_tokens: int = Field(2048, gt=0, description="tokens per forward at most")
    max_model_len: int | None = Field(None, gt=0, description="prompt + response; None = model's")
    enable_prefix_caching: bool = True
    enforce_eager: bool = Field(
        False,
        description="on CUDA, run decode steps eagerly instead of through CUDA graphs "
        "captured per batch-size bucket (vLLM's switch); CPU is always eager",
    )
    tp_policy: TPPolicy = Field(default_factory=StaticTP, description="static or adaptive TP")
    tp_comm: Literal["auto", "shm", "process_group"] = Field(
        "auto",
        description="the TP group's per-step collectives: shm = shared memory (gloo groups on "
        "one host, x86-64), process_group = the group's backend, auto = shm where it can",
    )
    keep_full_weights: bool = Field(
        True,
        description="a fold out of tp 1 keeps each rank's full weights (plus copies of the "
        "shards that are not one contiguous block), so the way back and the next weight sync "
        "need no gather and no rebuild; off: the weights are cut in place and the rest "
        "handed back (less memory; the sync after a folded rollout rebuilds the model)",
    )
    speculative: SpeculativeConfig = Field(
        default_factory=SpeculativeConfig,
        description="speculative decoding from group and history drafts (off by default)",
    )
    # ---- LoRA: adapters on the decoder's linear layers (layers/linear.py, layers/lora.py)
    lora_rank: int = Field(0, ge=0, description="LoRA rank of the adapters; 0 = no adapters")
    lora_alpha: float = Field(16.0, gt=0, description="adapter scale = lora_alpha / lora_rank")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj"],
        description="HF projections that carry adapters (a fused layer adapts all its parts)",
    )  # fmt: skip
    lora_merged: bool = Field(
        False,
        description="fold the adapters into the weights after each load (no LoRA cost per "
        "step; each adapter load unmerges exactly, loads, merges again)",
    )
    tune_host_malloc: bool = Field(
        True,
        description="on CPU under glibc, keep freed memory for reuse instead of faulting in "
        "fresh pages for each step's logits (process-wide; see patrl.rollout.host_memory)",
    )

    @model_validator(mode="before")
    @classmethod
    def _resolve_backend_and_block_size(cls, data: Any) -> Any:
        """'auto' -> the backend this machine runs (flash only for a block size it takes), an
        unset block size -> that backend's; an explicit incompatible pair raises, naming both."""
        if not isinstance(data, dict):
            return data
        name, raw = data.get("attention_backend", "auto"), data.get("block_size")
        try:
            block_size = None if raw is None else int(raw)
        except (TypeError, ValueError):
            return data  # the field validator names the bad value
        if name not in attention_backend_names() or (block_size is not None and block_size <= 0):
            return data
        device = str(data.get("device", "auto"))
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        backend = resolve_attention_backend(name, block_size, cuda=cuda)
        resolved = resolve_block_size(backend, block_size)
        return {
            **data,
            "attention_backend": backend,
            "block_size": resolved if raw is None else raw,
        }

    def lora_kwargs(self) -> dict[str, Any]:
        """`load_model`'s LoRA arguments: none without adapters."""
        if self.lora_rank == 0:
            return {}
        targets = tuple(self.lora_target_modules)
        return {"lora": (self.lora_rank, self.lora_alpha, targets), "lora_merged": self.lora_merged}

    @model_validator(mode="after")
    def _merged_lora_at_static_tp(self) -> EngineConfig:
        if self.lora_merged and self.lora_rank and isinstance(self.tp_policy, AdaptiveTP):
            raise ValueError(
                "lora_merged=True runs at static TP only (a fold would re-cut merged weights "
                "whose unmerged copies keep the old cut): use tp_policy=StaticTP or "
                "lora_merged=False"
            )
        return self

    @field_validator("attention_backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in attention_backend_names():
            raise ValueError(
                f"unknown attention backend {value!r}; choose one of {attention_backend_names()}"
            )
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value not in ("auto", "cpu") and not value.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {value!r}")
        return value

    def torch_device(self) -> torch.device:
        """`device` as a torch device ('auto': cuda when available, else cpu)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The engine's dtype for a checkpoint stored in `checkpoint_dtype` (see `dtype`)."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if checkpoint_dtype == torch.float32 and self.torch_device().type == "cuda":
            return torch.bfloat16
        return checkpoint_dtype
