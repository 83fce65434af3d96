"""Build the demo's model and data once, cache them, and hand out their paths.

A built directory: `model/` (a Hugging Face Llama directory, tokenizer with chat template),
`data/train.jsonl` and `data/val.jsonl` (`{"prompt", "answer", "num_steps"}` rows for RL), and
`demo.json`, the manifest, written last: its presence marks a complete build. A build runs in a
temporary sibling renamed into place at the end; callers on one machine are serialised by a file
lock (the first builds, the others wait and load). Under torchrun call it before the first
collective, or on rank 0 then barrier: a rank waiting in a collective could time out meanwhile.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase

from patrl_examples.demo.evaluate import pass_at_one
from patrl_examples.demo.model import DemoModelConfig, build_demo_model
from patrl_examples.demo.sft import SFTConfig, train_sft
from patrl_examples.demo.task import (
    Problem,
    TaskConfig,
    generate_problems,
    read_jsonl,
    write_jsonl,
)
from patrl_examples.demo.tokenizer import build_tokenizer, prompt_text

# Bump when the build code changes what it produces in a way the recipe does not capture.
BUILD_VERSION = 2
MANIFEST = "demo.json"
_OUR_ENTRIES = frozenset({"model", "data", MANIFEST})
# Train, validation and SFT problems come from disjoint streams of the one seed.
_TRAIN_STREAM, _VAL_STREAM, _SFT_STREAM = 1, 2, 3


class DemoRecipe(BaseModel):
    """Everything a build depends on; its hash names the cache directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    task: TaskConfig = TaskConfig()
    model: DemoModelConfig = DemoModelConfig()
    sft: SFTConfig = SFTConfig()
    num_train: int = Field(4096, gt=0)
    num_val: int = Field(256, gt=0)
    eval_prompts: int = Field(128, gt=0, description="validation prompts the build evaluates")
    eval_samples: int = Field(4, ge=0, description="temperature-1 samples per prompt; 0 = skip")

    @classmethod
    def default(cls, seed: int = 0, quick: bool = False) -> DemoRecipe:
        """The real recipe, or a quick one (a barely trained model) for tests."""
        if not quick:
            return cls(seed=seed)
        sft = SFTConfig(steps=4, tokens_per_batch=512, pool_size=64, warmup_steps=1)
        return cls(seed=seed, sft=sft, num_train=64, num_val=16, eval_samples=0)

    def key(self) -> str:
        payload = json.dumps({"version": BUILD_VERSION, **self.model_dump()}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    def stream_seed(self, stream: int) -> int:
        return self.seed * 1000 + stream


@dataclass(frozen=True, slots=True)
class DemoAssets:
    """Paths of a complete build and what its manifest says about it."""

    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    prompt_key: str
    answer_key: str
    max_prompt_tokens: int  # longest chat-formatted prompt in either split
    max_response_tokens: int  # longest gold response (with its EOS) in either split
    manifest: dict[str, Any]

    @classmethod
    def load(cls, root: Path) -> DemoAssets:
        manifest = json.loads((root / MANIFEST).read_text())
        return cls(
            root=root,
            model_dir=root / "model",
            train_file=root / "data" / "train.jsonl",
            val_file=root / "data" / "val.jsonl",
            prompt_key="prompt",
            answer_key="answer",
            max_prompt_tokens=manifest["max_prompt_tokens"],
            max_response_tokens=manifest["max_response_tokens"],
            manifest=manifest,
        )


def default_cache_root() -> Path:
    env = os.environ.get("PATRL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "patrl"


def ensure_demo_assets(
    cache_dir: Path | None = None,
    *,
    seed: int = 0,
    quick: bool = False,
    progress: bool = True,
    recipe: DemoRecipe | None = None,
    threads: int = 1,
) -> DemoAssets:
    """The demo under `cache_dir/demo-<recipe hash>`, built on the first call.

    `cache_dir` defaults to $PATRL_CACHE_DIR, else ~/.cache/patrl. `recipe` overrides
    `seed`/`quick` with a fully custom recipe. `threads`: torch threads while building; one by
    default, since intra-op threads spin against each other on a loaded machine. The weights
    come out bit-identical either way.
    """
    recipe = recipe or DemoRecipe.default(seed, quick)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return ensure_demo_at(root / f"demo-{recipe.key()}", recipe, progress=progress, threads=threads)


def ensure_demo_at(
    target: Path, recipe: DemoRecipe, *, progress: bool = True, threads: int = 1
) -> DemoAssets:
    """The demo built by `recipe` in exactly `target`: reused when complete, else (re)built."""
    target = Path(target).absolute()
    if is_complete(target, recipe):
        return DemoAssets.load(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target, recipe):  # another process built it while we waited
            return DemoAssets.load(target)
        _remove_stale_temporaries(target)
        with torch_threads(threads):
            return build_demo(target, recipe, log=progress_logger(progress))


def is_complete(target: Path, recipe: DemoRecipe) -> bool:
    manifest = target / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return bool(json.loads(manifest.read_text()).get("key") == recipe.key())
    except json.JSONDecodeError:
        return False


def build_demo(
    target: Path, recipe: DemoRecipe, log: Callable[[str], None] | None = None
) -> DemoAssets:
    """Build into a temporary sibling, then swap it into `target` (replacing what is there).

    The caller holds the lock; `ensure_demo_at` is the safe entry point.
    """
    log = log or (lambda _: None)
    if target.exists():
        _check_replaceable(target)  # fail before the build, not after it
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _build_into(tmp, recipe, log)
        if target.exists():  # an incomplete build or another recipe's: replace it
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"demo ready in {target}")
    return DemoAssets.load(target)


def _build_into(out: Path, recipe: DemoRecipe, log: Callable[[str], None]) -> None:
    start = time.perf_counter()
    timings: dict[str, float] = {}
    data = out / "data"
    data.mkdir(parents=True)
    train = generate_problems(recipe.num_train, recipe.stream_seed(_TRAIN_STREAM), recipe.task)
    val = generate_problems(recipe.num_val, recipe.stream_seed(_VAL_STREAM), recipe.task)
    write_jsonl(train, data / "train.jsonl")
    write_jsonl(val, data / "val.jsonl")
    timings["data_s"] = time.perf_counter() - start

    tokenizer = build_tokenizer()
    torch.manual_seed(recipe.seed)
    model = build_demo_model(recipe.model, tokenizer)
    log(
        f"warm-starting a {_num_params(model) / 1e6:.2f}M-parameter Llama by SFT "
        f"({recipe.sft.steps} steps)"
    )
    t = time.perf_counter()
    losses = train_sft(
        model, tokenizer, recipe.task, recipe.sft, recipe.stream_seed(_SFT_STREAM), log
    )
    timings["sft_s"] = time.perf_counter() - t
    model_dir = out / "model"
    save_model(model, model_dir)
    tokenizer.save_pretrained(model_dir)

    evaluation = None
    if recipe.eval_samples > 0:
        t = time.perf_counter()
        rows = read_jsonl(data / "val.jsonl")[: recipe.eval_prompts]
        log(f"measuring pass@1 on {len(rows)} validation prompts")
        result = pass_at_one(
            model_dir,
            [str(r["prompt"]) for r in rows],
            [str(r["answer"]) for r in rows],
            samples=recipe.eval_samples,
            seed=recipe.seed,
        )
        evaluation = {
            "pass@1_greedy": result.greedy,
            "pass@1_temperature_1": result.temperature_1,
            "samples_per_prompt": result.samples_per_prompt,
            "num_prompts": result.num_prompts,
            "mean_response_tokens_temperature_1": result.mean_response_tokens,
            "worked_greedy": result.worked_greedy,
            "worked_temperature_1": result.worked_temperature_1,
        }
        timings["eval_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - start

    manifest = {
        "key": recipe.key(),
        "build_id": uuid.uuid4().hex,  # tells two builds of one recipe apart
        "build_version": BUILD_VERSION,
        "recipe": recipe.model_dump(),
        "num_parameters": _num_params(model),
        "final_sft_loss": sum(losses[-20:]) / len(losses[-20:]),
        "solution_tokens": solution_token_stats(val, tokenizer),
        "max_prompt_tokens": max(_prompt_tokens(p, tokenizer) for p in train + val),
        "max_response_tokens": max(_response_tokens(p, tokenizer) for p in train + val),
        "evaluation": evaluation,
        "timings": timings,
        "torch_threads": torch.get_num_threads(),
    }
    # Written last: a directory with a manifest is a complete one.
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def solution_token_stats(
    problems: list[Problem], tokenizer: PreTrainedTokenizerBase
) -> dict[str, float]:
    """Token counts of the gold responses (solution + EOS): the lengths RL will see."""
    lengths = sorted(_response_tokens(p, tokenizer) for p in problems)

    def pct(q: float) -> float:
        return float(lengths[min(len(lengths) - 1, int(q * len(lengths)))])

    return {
        "median": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": float(lengths[-1]),
        "mean": sum(lengths) / len(lengths),
    }


def _response_tokens(problem: Problem, tokenizer: PreTrainedTokenizerBase) -> int:
    return len(tokenizer.encode(problem.solution(), add_special_tokens=False)) + 1


def _prompt_tokens(problem: Problem, tokenizer: PreTrainedTokenizerBase) -> int:
    return len(tokenizer.encode(prompt_text(tokenizer, problem.prompt), add_special_tokens=False))


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _check_replaceable(target: Path) -> None:
    # Never delete a directory the demo did not write (a mistyped --out, say).
    foreign = sorted(p.name for p in target.iterdir() if p.name not in _OUR_ENTRIES)
    if foreign:
        raise FileExistsError(
            f"{target} exists and holds {foreign[:5]}, which a demo build did not write: "
            "point the demo at a new or empty directory, or at an earlier demo build"
        )


def save_model(model: Any, model_dir: Path) -> None:
    """What `save_pretrained` writes for the demo model (config, generation config, one
    safetensors file), written directly: under an initialised torch.distributed, transformers 5
    writes nothing on a rank other than 0, and whichever rank wins the build lock builds."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    config.architectures = [type(model).__name__]
    config.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config.save_pretrained(model_dir)
    model.generation_config.save_pretrained(model_dir)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:  # the head is the embedding: saved once, as HF does
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def _remove_stale_temporaries(target: Path) -> None:
    # Only called under the lock, so no live build of this target owns one of these.
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def progress_logger(progress: bool) -> Callable[[str], None] | None:
    if not progress:
        return None
    return lambda msg: print(f"[patrl demo] {msg}", file=sys.stderr, flush=True)
