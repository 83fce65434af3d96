"""The demo task as the main job's default assets: this module is what the examples project
registers under the `patrl.assets` entry point group as `demo` (examples/pyproject.toml), and
what `patrl.orchestrator.demo_provider` loads when a job leaves `model.path` unset or names
`data.train_files: demo`. The orchestrator never imports this package by name; it reads these
three functions through that entry point (its `DemoProvider` protocol).
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from patrl_examples.demo import tokenizer
from patrl_examples.demo.assets import (
    DemoAssets,
    DemoRecipe,
    default_cache_root,
    ensure_demo_assets,
    is_complete,
)


def built_assets(
    cache_dir: Path | None = None, recipe: DemoRecipe | None = None
) -> DemoAssets | None:
    """The demo of `recipe` (default: the default recipe) if it is already built under
    `cache_dir` (default: $PATRL_CACHE_DIR, else ~/.cache/patrl), where `ensure_demo_assets`
    puts it; else None. Reads the cache only: builds and writes nothing."""
    recipe = recipe or DemoRecipe.default()
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / f"demo-{recipe.key()}"
    return DemoAssets.load(target) if is_complete(target, recipe) else None


def ensure_assets(progress: bool = True) -> DemoAssets:
    """The default demo, built into the cache on the first call (minutes of SFT; one builder
    per machine under a file lock, the other callers wait and load it)."""
    return ensure_demo_assets(progress=progress)


def build_tokenizer() -> PreTrainedTokenizerBase:
    """The demo model's tokenizer, built in memory (no file is read or written)."""
    return tokenizer.build_tokenizer()
