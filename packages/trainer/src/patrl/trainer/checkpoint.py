"""Resumable checkpoints (torch.distributed.checkpoint) and Hugging Face export.

A checkpoint directory is written under `<dir>.tmp`, completed with a `COMPLETE` marker and only
then renamed to `<dir>`, so a crash leaves either the previous checkpoint or none, never a
partial one that `load_checkpoint` would accept. Model and optimizer go through DCP (each rank
writes its shards); the small per-rank rest (LR scheduler, step, RNG, counters) is a torch file
per rank, so a checkpoint is resumed on the same number of trainer ranks it was saved on.
See docs/training.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer
from transformers import PretrainedConfig

from patrl.trainer.weights import iter_full_weights

MARKER = "COMPLETE"
# Tokenizer files copied verbatim from the source model directory into an HF export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


class Group:
    """The trainer's ranks: rank, size and barrier, with `None` meaning a lone process."""

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg) if pg is not None else 0
        self.size = dist.get_world_size(pg) if pg is not None else 1

    def barrier(self) -> None:
        if self.pg is not None:
            dist.barrier(group=self.pg)


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Optimizer,
    extra: dict[str, Any],
    group: Group,
) -> Path:
    """Write model + optimizer (DCP) and this rank's `extra` state atomically to `path`."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if group.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    group.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _lone_process_is_intended():
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=tmp,
            process_group=group.pg,
            no_dist=group.pg is None,
        )
    torch.save({**extra, "rng": _rng_state()}, tmp / f"trainer_state_rank{group.rank}.pt")
    group.barrier()
    if group.rank == 0:
        (tmp / MARKER).write_text(json.dumps({"world_size": group.size, "step": extra["step"]}))
        _replace_dir(tmp, final)
    group.barrier()
    return final


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: Optimizer, group: Group
) -> dict[str, Any]:
    """Restore model + optimizer in place and RNG states; return this rank's `extra` state."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a complete checkpoint (no {MARKER} marker): it does not "
            "exist or its save did not finish"
        )
    saved_world = json.loads(marker.read_text())["world_size"]
    if saved_world != group.size:
        raise ValueError(
            f"checkpoint {str(path)!r} was saved by {saved_world} trainer ranks; "
            f"it can be loaded by {saved_world} ranks, not {group.size}"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # DCP loads into the given state dicts in place.
    with _lone_process_is_intended():
        dcp.load(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=path,
            process_group=group.pg,
            no_dist=group.pg is None,
        )
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    extra: dict[str, Any] = torch.load(
        path / f"trainer_state_rank{group.rank}.pt", weights_only=False
    )
    _set_rng_state(extra.pop("rng"))
    group.barrier()
    return extra


def export_hf(
    path: str | Path,
    model: nn.Module,
    config: PretrainedConfig,
    tokenizer_dir: Path | None,
    group: Group,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 1 << 28,
) -> Path:
    """Write `model.safetensors` + config (+ tokenizer files) loadable by `from_pretrained`.

    Every rank takes part in gathering; only rank 0 holds the tensors and writes.
    """
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    tensors: dict[str, torch.Tensor] = {}
    for bucket in iter_full_weights(model, bucket_bytes, dtype):
        if group.rank == 0:
            tensors.update({name: t.detach().cpu().contiguous() for name, t in bucket})
    if group.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        saved_config = copy.deepcopy(config)
        saved_config.dtype = dtype or next(iter(tensors.values())).dtype
        saved_config.save_pretrained(tmp)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer_dir / name).is_file():
                    shutil.copy2(tokenizer_dir / name, tmp / name)
        _replace_dir(tmp, final)
    group.barrier()
    return final


@contextlib.contextmanager
def _lone_process_is_intended() -> Iterator[None]:
    # DCP warns that it "assumes" a single process; without a group that is exactly our intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` is moved aside first and removed after."""
    old = dst.with_name(dst.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        dst.rename(old)
    src.rename(dst)
    shutil.rmtree(old, ignore_errors=True)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
