"""RLHF stage 2 on the demo: a tiny reward model trained on the demo's preference pairs, cached.

The RM starts from the demo's SFT model (its backbone, a new seeded score head) and is trained
by `BradleyTerryTrainer` on `preferences.preference_pairs`. A built directory: `model/` (an HF
sequence-classification directory with the demo tokenizer), `data/{train,val}.jsonl` and
`rm.json` (the manifest with the held-out accuracy), written last: its presence marks a complete
build. Like the demo, it is built in a temporary sibling under a file lock, then renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from patrl_examples.demo.assets import DemoAssets, file_lock, torch_threads
from patrl_examples.demo.preferences import (
    DEFAULT_KINDS,
    REJECTED_KINDS,
    write_preference_splits,
)

BUILD_VERSION = 1
MANIFEST = "rm.json"


class RewardModelRecipe(BaseModel):
    """What the RM build depends on besides the demo model; part of the cache key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    num_train: int = Field(512, gt=0, description="training pairs")
    num_val: int = Field(256, gt=0, description="held-out pairs")
    kinds: tuple[str, ...] = DEFAULT_KINDS
    epochs: int = Field(1, gt=0)
    batch_size: int = Field(16, gt=0, description="pairs per optimizer step")
    lr: float = Field(1e-3, gt=0)
    max_length: int = Field(512, gt=0, description="tokens per sequence at most")

    def key(self, demo: DemoAssets) -> str:
        payload = {"version": BUILD_VERSION, "demo": demo.manifest["build_id"], **self.model_dump()}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]

    def check(self) -> None:
        unknown = sorted(set(self.kinds) - set(REJECTED_KINDS))
        if not self.kinds or unknown:
            raise ValueError(f"kinds {list(self.kinds)}; accepted: {list(REJECTED_KINDS)}")


@dataclass(frozen=True, slots=True)
class DemoRewardModel:
    """Paths of a complete RM build and its manifest."""

    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    manifest: dict[str, Any]

    @property
    def val_accuracy(self) -> float:
        return float(self.manifest["val_accuracy"])

    @classmethod
    def load(cls, root: Path) -> DemoRewardModel:
        manifest = json.loads((root / MANIFEST).read_text())
        data = root / "data"
        return cls(root, root / "model", data / "train.jsonl", data / "val.jsonl", manifest)


def ensure_demo_reward_model(
    demo: DemoAssets,
    recipe: RewardModelRecipe | None = None,
    cache_dir: Path | None = None,
    *,
    threads: int = 1,
    log: Any = None,
) -> DemoRewardModel:
    """The RM of `demo` and `recipe` under `cache_dir/rm-<key>` (default: beside the demo),
    built on the first call; later calls (any process) load it."""
    recipe = recipe or RewardModelRecipe()
    recipe.check()
    target = (Path(cache_dir) if cache_dir else demo.root.parent) / f"rm-{recipe.key(demo)}"
    if _complete(target):
        return DemoRewardModel.load(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if _complete(target):
            return DemoRewardModel.load(target)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with torch_threads(threads):
                build_reward_model(tmp, demo, recipe, log or (lambda _: None))
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return DemoRewardModel.load(target)


def build_reward_model(out: Path, demo: DemoAssets, recipe: RewardModelRecipe, log: Any) -> None:
    """Pairs, Bradley-Terry training from the demo model, held-out accuracy, manifest last."""
    from patrl.trainer.reward_model import (
        BradleyTerryTrainer,
        load_tokenizer,
        read_preferences,
        tokenize_pairs,
    )

    start = time.perf_counter()
    train_file, val_file = write_preference_splits(
        out / "data", recipe.num_train, recipe.num_val, recipe.seed, kinds=recipe.kinds
    )
    tokenizer = load_tokenizer(demo.model_dir, "the demo model")
    train = tokenize_pairs(read_preferences(train_file), tokenizer, recipe.max_length)
    val = tokenize_pairs(read_preferences(val_file), tokenizer, recipe.max_length)
    trainer = BradleyTerryTrainer(demo.model_dir, lr=recipe.lr, seed=recipe.seed)
    log(f"training a reward model on {len(train)} preference pairs ({recipe.epochs} epoch(s))")
    losses = []
    for epoch in range(recipe.epochs):
        for s in range(0, len(train) - recipe.batch_size + 1, recipe.batch_size):
            losses.append(trainer.train_step(train[s : s + recipe.batch_size])["loss"])
        log(f"rm epoch {epoch + 1}: last train loss {losses[-1]:.4f}")
    held_out = trainer.evaluate(val)
    log(f"rm held-out accuracy {held_out['accuracy']:.3f} on {len(val)} pairs")
    trainer.save(out / "model", tokenizer)
    manifest = {
        "recipe": recipe.model_dump(),
        "demo": str(demo.root),
        "steps": len(losses),
        "final_train_loss": losses[-1] if losses else None,
        "val_loss": held_out["loss"],
        "val_accuracy": held_out["accuracy"],
        "build_s": time.perf_counter() - start,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _complete(target: Path) -> bool:
    return (target / MANIFEST).is_file()
