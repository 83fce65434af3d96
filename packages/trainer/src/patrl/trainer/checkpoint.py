"""Resumable checkpoints (torch.distributed.checkpoint), loadable at any number of ranks.

A checkpoint directory is written under `<dir>.tmp`, completed with a `COMPLETE` marker and only
then renamed to `<dir>`, so a crash leaves either the previous checkpoint or none, never a
partial one that `load_checkpoint` would accept. What it holds is `contents` (verl's
`checkpoint.save_contents`): "model" and "optimizer" go through DCP as FSDP2's DTensor state
dicts, each rank writing its shards; "extra" (LR scheduler, step, RNG, counters) is a torch file
per rank. DCP records every tensor's global shape, so a checkpoint loads on any number of ranks
(resharded on read); the extra state is the same on every rank except the RNG, which a rank
takes from the saved rank of its own index modulo the saved world size. The marker records
the world size, step, contents, the model's head and its source directory, which
`python -m patrl.trainer.export` reads. See docs/training.md.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from patrl.trainer.config import CHECKPOINT_CONTENTS, RESUMABLE_CONTENTS

MARKER = "COMPLETE"
EXTRA_FILE = "trainer_state_rank{rank}.pt"


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
    contents: Sequence[str] = CHECKPOINT_CONTENTS,
    about: dict[str, Any] | None = None,
) -> Path:
    """Write what `contents` names of model + optimizer (DCP) and this rank's `extra` state
    atomically to `path` ("hf_model" is the caller's: hf_export.py). `about` (JSON values) is
    recorded in the marker beside the world size, step and contents."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if group.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    group.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {
        key: sd
        for key, sd, content in (("model", model_sd, "model"), ("optim", optim_sd, "optimizer"))
        if content in contents
    }
    if state:
        with _lone_process_is_intended():
            dcp.save(state, checkpoint_id=tmp, process_group=group.pg, no_dist=group.pg is None)
    if "extra" in contents:
        torch.save({**extra, "rng": _rng_state()}, tmp / EXTRA_FILE.format(rank=group.rank))
    group.barrier()
    if group.rank == 0:
        marker = {
            "world_size": group.size,
            "step": extra["step"],
            "contents": [c for c in CHECKPOINT_CONTENTS if c in contents],
            **(about or {}),
        }
        (tmp / MARKER).write_text(json.dumps(marker))
        replace_dir(tmp, final)
    group.barrier()
    return final


def read_marker(path: str | Path) -> dict[str, Any]:
    """The marker of a complete checkpoint (world size, step, contents, what `about` gave);
    FileNotFoundError naming `path` when it is not one."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a complete checkpoint (no {MARKER} marker): it does not "
            "exist, its save did not finish, or it is not a trainer checkpoint"
        )
    about: dict[str, Any] = json.loads(marker.read_text())
    about.setdefault("contents", list(RESUMABLE_CONTENTS))  # written before contents existed
    return about


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: Optimizer, group: Group
) -> dict[str, Any]:
    """Restore model + optimizer in place (resharded from whatever world size saved them) and
    the RNG states; return this rank's `extra` state."""
    path = Path(path)
    marker = read_marker(path)
    missing = [c for c in RESUMABLE_CONTENTS if c not in marker["contents"]]
    if missing:
        raise ValueError(
            f"checkpoint {str(path)!r} holds {marker['contents']} (checkpoint.save_contents), "
            f"not {missing}: resuming needs {list(RESUMABLE_CONTENTS)}"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # DCP loads into the given state dicts in place, each rank reading the parts it holds.
    with _lone_process_is_intended():
        dcp.load(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=path,
            process_group=group.pg,
            no_dist=group.pg is None,
        )
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    saved_rank = group.rank % int(marker["world_size"])
    extra: dict[str, Any] = torch.load(
        path / EXTRA_FILE.format(rank=saved_rank), weights_only=False
    )
    _set_rng_state(extra.pop("rng"))
    group.barrier()
    return extra


@contextlib.contextmanager
def _lone_process_is_intended() -> Iterator[None]:
    # DCP warns that it "assumes" a single process; without a group that is exactly our intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def replace_dir(src: Path, dst: Path) -> None:
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
