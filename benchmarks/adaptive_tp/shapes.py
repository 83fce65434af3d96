"""Model shapes, the size of each shape's runs, and the model and engine config they need.

A shape's role decides the targets it is held to: a "crossover" shape (TP=2 faster for one
sequence, two tp-1 replicas faster for the full batch) to the long-tail speed-up, a "none"
shape to not switching. Why each shape was chosen is in `benchmarks/README.md`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from patrl.rollout import EngineConfig
from patrl.rollout.profile import ProfileGrid

BLOCK = 16
MAX_POSITIONS = 1024  # above the longest context any shape's runs reach


def vocab_2l(hidden: int) -> dict[str, Any]:
    """Qwen2.5-0.5B's 151,936-token vocabulary and untied head on 2 layers of width `hidden`
    (intermediate 5.5 times the width, heads of 64, or 32 where that gives an odd count, 2 KV heads)."""
    head_dim = 64 if (hidden // 64) % 2 == 0 else 32
    return dict(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 2 // 32 * 32,
        num_hidden_layers=2,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=False,
    )


# The vocab_2l family at any width is "vocab_2l_h<width>", role "crossover".
SHAPE_ROLE = MappingProxyType(
    {
        "mqa_20l": "crossover",
        "vocab_2l_h512": "crossover",
        "wide_2l": "none",
        "wide_6l": "none",
        "tiny": "none",
    }
)
SHAPES: MappingProxyType[str, dict[str, Any]] = MappingProxyType(
    {
        # Gemma-2B's attention (one KV head of 256) on 20 layers of width 512, Llama-2's 32k
        # vocabulary: a TP=2 group holds the one KV head on both ranks
        "mqa_20l": dict(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=20,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=32000,
            tie_word_embeddings=False,
        ),
        "wide_6l": dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=6,
            num_attention_heads=16,
            num_key_value_heads=8,
            vocab_size=8192,
            tie_word_embeddings=False,
        ),
        "wide_2l": dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=2,
            num_attention_heads=16,
            num_key_value_heads=8,
            vocab_size=8192,
            tie_word_embeddings=False,
        ),
        # Qwen2.5-0.5B's width, heads and vocabulary on 2 layers
        "vocab_2l": dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=2,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=False,
        ),
        "vocab_2l_h512": vocab_2l(512),
        # steps cost about as much as a collective: TP=2 never pays
        "tiny": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        ),
    }
)


@dataclass(frozen=True, slots=True)
class Scale:
    """How big one shape's runs are: `prompts_per_replica` prompts of `n` samples per replica,
    responses of at most `max_len` tokens, prompts of `prompt_len` tokens (inclusive), and the
    profile `grids` (measured in turn, rows merged). `min_repeats`: a floor on repeats for
    shapes whose rollouts are short enough for load bursts to dominate one run.
    `check_every`: decode steps between planner checks (None: the bench's setting).
    `context_per_seq`: tokens a sequence holds, for the profile summary."""

    prompts_per_replica: int
    n: int
    max_len: int
    prompt_len: tuple[int, int]
    grids: tuple[ProfileGrid, ...]
    min_repeats: int = 1
    check_every: int | None = None
    context_per_seq: int = 32

    @property
    def num_prompts(self) -> int:
        return 2 * self.prompts_per_replica

    @property
    def max_model_len(self) -> int:
        return self.prompt_len[1] + self.max_len + 1


def grid(
    batches: tuple[int, ...],
    contexts: tuple[int, ...],
    passes: int = 3,
    prefill: tuple[int, ...] = (16, 64, 256),
    samples_per_prompt: int = 1,
) -> ProfileGrid:
    """A 2-rank profile grid over tp 1 and 2 with the bench's collective sizes and steps."""
    return ProfileGrid(
        tp_sizes=(1, 2),
        batch_sizes=batches,
        contexts=contexts,
        prefill_tokens=prefill,
        samples_per_prompt=samples_per_prompt,
        collective_bytes=(4, 4096, 65536, 1 << 20, 4 << 20),
        decode_steps=4,
        passes=passes,
        warmup_steps=4,
    )


def scale_for(shape: str, quick: bool) -> Scale:
    """The run size of `shape` (`quick`: the smallest runs, any shape)."""
    if quick:
        return Scale(4, 2, 32, (8, 16), (grid((1, 2, 4, 8), (16, 48), passes=2),))
    if shape == "tiny":
        return Scale(8, 4, 160, (16, 24), (grid((1, 4, 16, 32), (16, 96, 184)),), min_repeats=15)
    # Large shapes profile two grids: every batch size at a short context, and fewer batches at
    # the long one, which pins the per-context-token term without minutes of prefill a cell.
    # Batches 2 and 3 are measured because single-threaded sgemm does not scale linearly
    # there, and a tail of a few sequences a replica is where a fold pays.
    if shape == "mqa_20l":
        # decode cells fork 8 samples a prompt, as the rollouts do
        profile = grid(
            (1, 2, 3, 4, 8, 16, 32, 64), (256, 576), prefill=(16, 128, 512), samples_per_prompt=8
        )
        return Scale(4, 8, 128, (448, 512), (profile,), check_every=8, context_per_seq=544)
    if shape.startswith("vocab_2l"):
        # 64 sequences: 32 per tp-1 replica
        return Scale(
            8,
            4,
            96,
            (16, 24),
            (grid((1, 2, 3, 4, 8, 16, 32, 64), (16,)), grid((1, 2, 3, 4, 16, 32), (112,))),
            check_every=8,
        )
    return Scale(4, 4, 96, (16, 24), (grid((1, 4, 16, 32), (16,)), grid((1, 4, 16), (112,))))


def shape_config(shape: str) -> dict[str, Any]:
    """The Llama config fields of a named shape, or of "vocab_2l_h<width>" for any width;
    exits naming the choices for an unknown one."""
    if shape in SHAPES:
        return SHAPES[shape]
    width = shape.removeprefix("vocab_2l_h")
    if shape.startswith("vocab_2l_h") and width.isdigit() and int(width) % 64 == 0:
        return vocab_2l(int(width))
    raise SystemExit(
        f"unknown shape {shape!r}; choose from {sorted(SHAPES)} or vocab_2l_h<width>, the "
        "width a multiple of 64"
    )


def shape_role(shape: str) -> str:
    return SHAPE_ROLE.get(shape, "crossover" if shape.startswith("vocab_2l") else "none")


def model_dir(shape: str, results: Path) -> Path:
    """Where the model of `shape` is saved: under $PATRL_CACHE_DIR, else `results`/models."""
    root = Path(os.environ.get("PATRL_CACHE_DIR", results / "models"))
    return root / f"adaptive_tp_{shape}"


def build_model(shape: str, results: Path) -> Path:
    """Rank 0 only: save a random-init fp32 Llama of `shape` once (write, then rename); a
    cached one of other dimensions is built again."""
    path = model_dir(shape, results)
    wanted = shape_config(shape)
    if (path / "config.json").is_file():
        cached = json.loads((path / "config.json").read_text())
        if all(cached.get(k) == v for k, v in wanted.items()):
            return path
        shutil.rmtree(path)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=MAX_POSITIONS, **wanted)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


def base_config(model: Path, scale: Scale) -> EngineConfig:
    """The static engines' config: KV blocks for every sample of the rollout on one replica
    (each prompt's blocks once, each sample's response and its copy of the prompt's last
    partial block, plus slack), so a fold to tp 2 never runs out."""
    prompt_blocks = scale.num_prompts * -(-scale.prompt_len[1] // BLOCK)
    sample_blocks = scale.num_prompts * scale.n * (-(-scale.max_len // BLOCK) + 2)
    return EngineConfig(
        model=str(model),
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=prompt_blocks + sample_blocks + 16,
        max_num_seqs=scale.num_prompts * scale.n,
        max_num_batched_tokens=max(2048, scale.max_model_len),
        max_model_len=scale.max_model_len,
    )
