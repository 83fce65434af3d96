"""Load each rank's own FSDP2 shards of a model straight from a Hugging Face safetensors
directory, so that no rank ever holds the full model.

A parameter sharded by `fully_shard` is a DTensor placed `Shard(0)` on a 1-D mesh: rank `r`
holds rows `[r * c, min((r + 1) * c, n))` of its `n` rows, `c = ceil(n / world)`. Those rows
are read with `safe_open(...).get_slice(name)` and cast into the rank's local tensor. The file
is opened per tensor: a slice is a view of the file's memory map, and the pages it touched stay
resident until the map is released. See docs/training.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_index(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of `path` that holds it."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"model directory {str(path)!r} has no *.safetensors file; the sharded build reads "
            "safetensors only (convert the checkpoint with save_pretrained(safe_serialization=True))"
        )
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def load_shards(model: nn.Module, path: Path, skip: Collection[str] = ()) -> None:
    """Fill every parameter and persistent buffer of `model` (materialised, possibly sharded)
    from the checkpoint in `path`, in place, cast to the target's dtype. Tied tensors are read
    once, under whichever of their names the checkpoint holds; tensors named in `skip` (a new
    head the caller initialises) are left as they are."""
    index = checkpoint_index(path)
    with torch.no_grad():
        for names, target in _targets(model):
            if any(n in skip for n in names):
                continue
            name = next((n for n in names if n in index), None)
            if name is None:
                raise KeyError(
                    f"checkpoint {str(path)!r} holds none of {names} (model "
                    f"{type(model).__name__}); its tensors are named like {sorted(index)[:3]}"
                )
            _load_one(target, index[name], name)


def shard_rows(target: DTensor) -> tuple[int, int]:
    """The rows `[start, stop)` of the global tensor that this rank's shard of `target` holds."""
    if target.device_mesh.ndim != 1 or tuple(target.placements) != (Shard(0),):
        raise ValueError(
            f"sharded load expects a DTensor placed (Shard(0),) on a 1-D mesh, got "
            f"{tuple(target.placements)} on {target.device_mesh}"
        )
    rows, world = target.shape[0], target.device_mesh.size()
    chunk = math.ceil(rows / world)
    start = min(target.device_mesh.get_local_rank() * chunk, rows)
    stop = min(start + chunk, rows)
    local_rows = target.to_local().shape[0]
    if local_rows != stop - start:
        raise ValueError(
            f"this rank's shard has {local_rows} rows; the chunking rule gives rows "
            f"[{start}, {stop}) of {rows} over {world} ranks"
        )
    return start, stop


def _targets(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """(all names, tensor) of each distinct parameter / persistent buffer, in state-dict order."""
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(by_id.values())


def _load_one(target: torch.Tensor, file: Path, name: str) -> None:
    with safe_open(str(file), "pt") as f:
        piece = f.get_slice(name)
        shape = tuple(piece.get_shape())
        if shape != tuple(target.shape):
            raise ValueError(
                f"{name!r} in {str(file)!r} has shape {shape}; the model expects "
                f"{tuple(target.shape)}"
            )
        if isinstance(target, DTensor):
            start, stop = shard_rows(target)
            target.to_local().copy_(piece[start:stop])
        else:
            target.copy_(f.get_tensor(name))
