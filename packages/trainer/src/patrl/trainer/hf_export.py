"""Hugging Face model directories from patrl's weights, loadable by `from_pretrained` and by
patrl's rollout engine.

A directory holds the weights as safetensors under their HF names (one `model.safetensors`, or
`model-0000i-of-0000n.safetensors` files of at most `max_shard_bytes` plus the index), the
model's `config.json` (architecture of its head, `use_cache` on, `dtype` of the weights),
`generation_config.json` (the source model's, else derived from the config) and the source's
tokenizer files. It is built in `<dir>.tmp` and renamed, so it is whole or absent. The weights
are written in the source model's dtype by default (`source_dtype`): an export is a drop-in
replacement for the model training started from. Two producers feed `write_weights`: a live,
possibly FSDP-sharded model (`export_hf`) and a DCP checkpoint read by one process (export.py).
See docs/training.md.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, GenerationConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)

from patrl.trainer.checkpoint import Group, replace_dir
from patrl.trainer.weights import iter_merged_weights

# Tokenizer files copied verbatim from the source model directory.
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
GENERATION_CONFIG = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' customary shard size
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ARCHITECTURES = {
    "lm": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "value": MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
}


def source_dtype(config: PretrainedConfig | None) -> torch.dtype:
    """The dtype a model's weights are stored in (its config's `dtype`), float32 when the
    config names none or a non-float one."""
    value = getattr(config, "dtype", None) if config is not None else None
    if isinstance(value, torch.dtype):
        return value if value in _FLOAT_DTYPES.values() else torch.float32
    return _FLOAT_DTYPES.get(str(value).removeprefix("torch."), torch.float32)


def read_source_config(source_dir: Path | None) -> PretrainedConfig | None:
    """The config.json of a source model directory, as saved (None without a directory)."""
    if source_dir is None:
        return None
    return AutoConfig.from_pretrained(str(source_dir), local_files_only=True)


def hf_config(config: PretrainedConfig, head: str, dtype: torch.dtype) -> PretrainedConfig:
    """`config` as an exported directory states it: the architecture of `head` ("lm": causal
    LM, "value": token classification), the KV cache on (training turns it off), `dtype`."""
    names = _ARCHITECTURES[head]
    if config.model_type not in names:
        raise ValueError(
            f"no transformers {'causal LM' if head == 'lm' else 'token-classification'} class "
            f"for model_type {config.model_type!r}"
        )
    out = copy.deepcopy(config)
    out.architectures = [names[config.model_type]]
    out.use_cache = True
    out.dtype = dtype
    return out


def write_metadata(out: Path, config: PretrainedConfig, source_dir: Path | None) -> None:
    """config.json, generation_config.json and the tokenizer files of `source_dir` into `out`."""
    config.save_pretrained(out)
    if source_dir is not None and (source_dir / GENERATION_CONFIG).is_file():
        shutil.copy2(source_dir / GENERATION_CONFIG, out / GENERATION_CONFIG)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(out)
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            if (source_dir / name).is_file():
                shutil.copy2(source_dir / name, out / name)


def copy_metadata(src: Path, out: Path) -> None:
    """The config, generation config and tokenizer files of one HF directory into another."""
    for name in ("config.json", GENERATION_CONFIG, *TOKENIZER_FILES):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


class ShardWriter:
    """Writes `(name, tensor)` pairs into safetensors files of at most `max_bytes` each (a
    larger tensor gets a file of its own), holding at most one file's tensors on the host."""

    def __init__(self, out: Path, max_bytes: int = MAX_SHARD_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in names for _, names in self.parts):
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def close(self) -> list[Path]:
        """Name the files as transformers does (with an index when there are several)."""
        self._flush()
        n = len(self.parts)
        if n == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (part, tensors), name in zip(self.parts, names, strict=True):
            part.rename(self.out / name)
            weight_map.update(dict.fromkeys(tensors, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        return [self.out / name for name in names]

    def _flush(self) -> None:
        if not self.pending:
            return
        part = self.out / f"part-{len(self.parts):05d}.safetensors.tmp"
        save_file(self.pending, str(part), metadata={"format": "pt"})
        self.parts.append((part, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0


def check_writable(out: Path, flag: str) -> None:
    """ValueError naming `flag` unless this process may create or fill the directory `out`:
    it, or the nearest part of its path that exists, is a directory it may write (checked
    without writing, so that a long job fails before its work, not at its save)."""
    import os

    existing = out.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        why = "is on a read-only filesystem" if read_only else "is not writable"
        raise ValueError(f"{flag} {out}: {existing} {why}; choose a writable directory")


def write_hf_dir(
    path: Path,
    tensors: Iterable[tuple[str, torch.Tensor]] | None,
    config: PretrainedConfig,
    source_dir: Path | None,
    metadata_from: Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Stage `path`, write `tensors` (None: no weights), then the metadata (from `source_dir`,
    or copied from the HF directory `metadata_from`) and rename it into place (one process);
    on any failure the staging directory is removed and `path` left as it was."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if tensors is not None:
            writer = ShardWriter(tmp, max_shard_bytes)
            for name, tensor in tensors:
                writer.add(name, tensor)
            writer.close()
        if metadata_from is not None:
            copy_metadata(metadata_from, tmp)
            config.save_pretrained(tmp)
        else:
            write_metadata(tmp, config, source_dir)
    except BaseException:  # a failed read or write (or Ctrl-C) leaves nothing half-written
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, path)
    return path


def export_hf(
    path: str | Path,
    model: nn.Module,
    config: PretrainedConfig,
    source_dir: Path | None,
    group: Group,
    dtype: torch.dtype | None = None,
    weights: bool = True,
    bucket_bytes: int = 1 << 28,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write the HF directory of `model` (whose exported `config` is given) to `path`.

    Collective over `group` when `weights`: every rank gathers each full tensor in turn, the
    first rank alone writes (holding at most one shard file on the host). `weights` False
    writes config, generation config and tokenizer only. `dtype` None: the master dtype.
    """
    final = Path(path)
    # A LoRA model exports merged: a plain HF model of the base with the adapters folded in.
    buckets = iter_merged_weights(model, bucket_bytes, dtype) if weights else None
    if group.rank != 0:
        for _ in buckets or ():  # the gathers are collectives: take part, keep nothing
            pass
    else:
        tensors = None if buckets is None else (pair for bucket in buckets for pair in bucket)
        write_hf_dir(final, tensors, config, source_dir, max_shard_bytes=max_shard_bytes)
    group.barrier()
    return final
