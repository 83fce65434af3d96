"""The embedded default of the main job: a tiny Llama with its own tokenizer, warm-started by
SFT on a synthetic long-tailed addition task (worked solutions mixed with bare answers), with
train/validation JSONL, built on first use and cached."""

from patrl_examples.demo.assets import (
    DemoAssets,
    DemoRecipe,
    default_cache_root,
    ensure_demo_assets,
    ensure_demo_at,
)
from patrl_examples.demo.evaluate import PassAtOne, boxed_answer, pass_at_one
from patrl_examples.demo.model import DemoModelConfig
from patrl_examples.demo.sft import SFTConfig
from patrl_examples.demo.task import Problem, TaskConfig, generate_problems
from patrl_examples.demo.tokenizer import build_tokenizer

__all__ = [
    "DemoAssets",
    "DemoModelConfig",
    "DemoRecipe",
    "PassAtOne",
    "Problem",
    "SFTConfig",
    "TaskConfig",
    "boxed_answer",
    "build_tokenizer",
    "default_cache_root",
    "ensure_demo_assets",
    "ensure_demo_at",
    "generate_problems",
    "pass_at_one",
]
