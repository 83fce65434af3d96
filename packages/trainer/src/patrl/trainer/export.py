"""`python -m patrl.trainer.export CKPT OUT`: the Hugging Face directory of a checkpoint.

CKPT is a run checkpoint (`<run dir>/checkpoints/global_step_<N>`: its policy, `trainer/`) or
any trainer checkpoint (a directory `Trainer.save` wrote, e.g. a run's `global_step_<N>/critic`),
saved by any number of ranks. One process reads it through DCP, a shard file's worth of
tensors at a time, and writes OUT as hf_export.py describes: the tensors `Trainer.export_hf`
would write, in the same dtype. Config, generation config and tokenizer come from `--model DIR`
when given, else from the checkpoint's own HF directory (`huggingface/` beside `trainer/`, or
inside a trainer checkpoint), else from the source model directory the checkpoint recorded.
A LoRA run's checkpoint is exported merged (each adapter folded into its base weight, in fp32,
at the scale its `lora_adapter/adapter_config.json` records): a plain HF model. Its PEFT
adapter directory is `lora_adapter/` of the checkpoint itself.

    python -m patrl.trainer.export runs/patrl/grpo/checkpoints/global_step_20 ./my-model
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig, PretrainedConfig

from patrl.trainer.checkpoint import MARKER, read_marker
from patrl.trainer.hf_export import (
    MAX_SHARD_BYTES,
    check_writable,
    hf_config,
    source_dtype,
    write_hf_dir,
)
from patrl.trainer.lora import LORA_ADAPTER_DIR
from patrl.trainer.model import Head, build_on_meta, with_head

RUN_POLICY_DIR = "trainer"  # a run checkpoint's policy (patrl.orchestrator.run_checkpoint)
HF_DIR = "huggingface"  # a checkpoint's HF directory (verl's name)
# A run checkpoint's record of its files and their sizes (patrl.orchestrator.run_checkpoint).
MANIFEST_FILE = "manifest.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def locate(checkpoint: Path) -> tuple[Path, Path]:
    """(the trainer checkpoint to read, where its HF directory would be) for a run checkpoint
    or a trainer checkpoint; FileNotFoundError naming `checkpoint` for anything else."""
    if (checkpoint / RUN_POLICY_DIR / MARKER).is_file():
        return checkpoint / RUN_POLICY_DIR, checkpoint / HF_DIR
    if (checkpoint / MARKER).is_file():
        return checkpoint, checkpoint / HF_DIR
    raise FileNotFoundError(
        f"{str(checkpoint)!r} is not a complete patrl checkpoint: it has neither {MARKER} nor "
        f"{RUN_POLICY_DIR}/{MARKER}; pass a run checkpoint (<run dir>/checkpoints/"
        "global_step_<N>), its critic/, or a directory Trainer.save wrote"
    )


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    model: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write the HF directory of `checkpoint`'s model to `out` (which must not exist or be
    empty); `model`: the source model directory for config and tokenizer; `dtype` None: the
    source model's."""
    trainer_dir, hf_dir = locate(Path(checkpoint))
    about = read_marker(trainer_dir)
    if "model" not in about["contents"]:
        raise ValueError(
            f"checkpoint {str(trainer_dir)!r} holds {about['contents']}: no model weights to "
            "export (it was saved without 'model' in checkpoint.save_contents)"
        )
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{str(out)!r} exists and is not an empty directory")
    check_writable(out.parent, "the directory of OUT")  # OUT.tmp is made beside OUT
    check_manifest(trainer_dir, hf_dir)
    head: Head = "value" if about.get("head") == "value" else "lm"
    config, source, metadata_from = _metadata(trainer_dir, hf_dir, model, about, head)
    dtype = dtype or source_dtype(config)
    config = hf_config(config, head, dtype)
    shapes, names = _expected_tensors(config, head)
    config_from = (
        f"--model {str(model)!r}" if model is not None else repr(str(source or metadata_from))
    )
    stored = _stored_tensors(trainer_dir)
    adapters = {n: m for n, m in stored.items() if ".lora_A." in n or ".lora_B." in n}
    stored = {n: m for n, m in stored.items() if n not in adapters}
    _check_tensors(trainer_dir, stored, shapes, names, config_from)
    if adapters:  # read in fp32, merged, then cast
        scaling = _lora_scaling(trainer_dir)
        full = _read_tensors(trainer_dir, stored, list(shapes), torch.float32, max_shard_bytes)
        tensors = _merged(full, trainer_dir, adapters, scaling, dtype)
    else:
        tensors = _read_tensors(trainer_dir, stored, list(shapes), dtype, max_shard_bytes)
    return write_hf_dir(out, tensors, config, source, metadata_from, max_shard_bytes)


def check_manifest(trainer_dir: Path, hf_dir: Path) -> None:
    """Raise ValueError naming each file of `trainer_dir` and `hf_dir` that is missing or of
    another size than the manifest of the run checkpoint they belong to records (a save cut
    short, or a file damaged since); nothing to check where there is no manifest (a
    checkpoint `Trainer.save` wrote by itself). Run before anything is read or written, so a
    damaged checkpoint is named instead of failing inside DCP."""
    for root in (trainer_dir, trainer_dir.parent):
        if (root / MANIFEST_FILE).is_file():
            break
    else:
        return
    manifest = root / MANIFEST_FILE
    try:
        files: dict[str, int] = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{str(manifest)!r} is unreadable ({err})") from None
    problems = []
    for name, size in files.items():
        path = root / name
        if not any(path.is_relative_to(d) for d in (trainer_dir, hf_dir)):
            continue  # another part of the run checkpoint (the critic, the loop state)
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif (actual := path.stat().st_size) != size:
            problems.append(f"{path} is {actual} bytes, its manifest says {size}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(
            f"checkpoint {str(root)!r} is damaged: {'; '.join(problems[:3])}{more} (a save cut "
            "short, or files changed since); export another checkpoint of the run"
        )


def _metadata(
    trainer_dir: Path,
    hf_dir: Path,
    model: str | Path | None,
    about: dict[str, Any],
    head: Head,
) -> tuple[PretrainedConfig, Path | None, Path | None]:
    """(model config, source dir to take metadata from, HF dir to copy metadata from)."""
    if model is None and (hf_dir / "config.json").is_file():
        return AutoConfig.from_pretrained(str(hf_dir), local_files_only=True), None, hf_dir
    source = Path(model) if model is not None else None
    if source is None and about.get("source"):
        source = Path(about["source"])
    if source is None or not (source / "config.json").is_file():
        where = (
            f"--model {str(source)!r} has no config.json"
            if model is not None
            else (
                f"neither {str(hf_dir)!r} nor the recorded source "
                f"{about.get('source')!r} holds a config.json"
            )
        )
        raise FileNotFoundError(
            f"no model config for checkpoint {str(trainer_dir)!r}: {where}; pass --model DIR, "
            "the Hugging Face directory the run trained"
        )
    config = with_head(AutoConfig.from_pretrained(str(source), local_files_only=True), head)
    return config, source, None


def _expected_tensors(
    config: PretrainedConfig, head: Head
) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(the parameters of the model `config` describes with their shapes, in
    `named_parameters` order, tied ones once: the names and order of `Trainer.export_hf`;
    every name its state dict holds, tied ones under each name). Built on the meta device:
    no memory."""
    model = build_on_meta(copy.deepcopy(config), "sdpa", head)  # it edits the config it uses
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return shapes, set(model.state_dict())


def _stored_tensors(trainer_dir: Path) -> dict[str, TensorStorageMetadata]:
    """The model tensors the DCP checkpoint in `trainer_dir` holds, by HF name."""
    metadata = dcp.FileSystemReader(str(trainer_dir)).read_metadata()
    return {
        key.removeprefix("model."): meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }


def _check_tensors(
    trainer_dir: Path,
    stored: dict[str, TensorStorageMetadata],
    shapes: dict[str, tuple[int, ...]],
    names: set[str],
    config_from: str,
) -> None:
    """Raise ValueError unless the checkpoint holds every tensor of the config's model
    (`shapes`), each of that shape, and nothing the model has no place for (`names`): an
    export must load as the config it writes says."""
    missing = [n for n in shapes if n not in stored]
    extra = sorted(n for n in stored if n not in names)
    wrong = [
        f"{n!r} is {list(stored[n].size)} in the checkpoint, {list(shape)} in the config"
        for n, shape in shapes.items()
        if n in stored and tuple(stored[n].size) != shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} of its tensors missing, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{len(extra)} tensors it has no place for, e.g. {extra[:3]}")
    if wrong:
        problems.append(f"{len(wrong)} tensors of another shape, e.g. {'; '.join(wrong[:3])}")
    if problems:
        raise ValueError(
            f"checkpoint {str(trainer_dir)!r} holds a different model than the config of "
            f"{config_from}: {'; '.join(problems)}; pass --model DIR, the Hugging Face "
            "directory the run trained"
        )


def _read_tensors(
    trainer_dir: Path,
    stored: dict[str, TensorStorageMetadata],
    names: list[str],
    dtype: torch.dtype,
    max_bytes: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`names` (each in `stored`) read from the DCP checkpoint, whole, cast to `dtype`, a
    group of at most `max_bytes` (or one tensor) per read."""
    reader = dcp.FileSystemReader(str(trainer_dir))
    for group in _groups(
        names, {n: stored[n].size.numel() * dtype.itemsize for n in names}, max_bytes
    ):
        state = {
            f"model.{n}": torch.empty(stored[n].size, dtype=stored[n].properties.dtype)
            for n in group
        }
        with warnings.catch_warnings():  # DCP's "assuming a single process": it is one
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
        for n in group:
            yield n, state.pop(f"model.{n}").to(dtype)


def _lora_scaling(trainer_dir: Path) -> float:
    """lora_alpha / r of the adapter directory `Trainer.save` wrote beside the shards."""
    path = trainer_dir / LORA_ADAPTER_DIR / "adapter_config.json"
    if not path.is_file():
        raise ValueError(
            f"checkpoint {str(trainer_dir)!r} holds LoRA adapters but no {path.name} in "
            f"{LORA_ADAPTER_DIR}/ (their scale); it was not written by Trainer.save"
        )
    about = json.loads(path.read_text())
    return float(about["lora_alpha"]) / float(about["r"])


def _merged(
    tensors: Iterator[tuple[str, torch.Tensor]],
    trainer_dir: Path,
    adapters: dict[str, TensorStorageMetadata],
    scaling: float,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """fp32 `tensors`, each adapted weight replaced by W + scaling * B @ A, cast to `dtype`
    (the merge `Trainer.export_hf` writes)."""
    for name, tensor in tensors:
        module = name.removesuffix(".weight")
        a_name, b_name = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        if a_name in adapters and b_name in adapters:
            pair = dict(_read_tensors(trainer_dir, adapters, [a_name, b_name], torch.float32, 1))
            tensor = tensor + scaling * (pair[b_name] @ pair[a_name])
        yield name, tensor.to(dtype)


def _groups(names: list[str], nbytes: dict[str, int], max_bytes: int) -> Iterator[list[str]]:
    group: list[str] = []
    size = 0
    for name in names:
        if group and size + nbytes[name] > max_bytes:
            yield group
            group, size = [], 0
        group.append(name)
        size += nbytes[name]
    if group:
        yield group


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m patrl.trainer.export",
        description="Write the Hugging Face model directory of a patrl checkpoint.",
    )
    parser.add_argument(
        "checkpoint", help="global_step_<N> of a run, its critic/, or a Trainer.save directory"
    )
    parser.add_argument("out", help="the directory to write (must not exist, or be empty)")
    parser.add_argument("--model", help="source model directory: config and tokenizer")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), help="weights' dtype (default: the source model's)"
    )
    parser.add_argument(
        "--max-shard-bytes", type=int, default=MAX_SHARD_BYTES, help="largest safetensors file"
    )
    args = parser.parse_args(argv)
    if args.max_shard_bytes < 1:
        parser.error(f"--max-shard-bytes {args.max_shard_bytes}: accepted 1 or more")
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out,
            args.model,
            _DTYPES[args.dtype] if args.dtype else None,
            args.max_shard_bytes,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"patrl: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a write that failed midway (the disk filled, say)
        print(f"patrl: error: writing {args.out!r}: {err}; nothing was kept", file=sys.stderr)
        return 1
    except CheckpointException as err:  # damage the manifest could not see (none was written)
        cause = next(iter(err.failures.values()), err)
        print(
            f"patrl: error: checkpoint {args.checkpoint!r} cannot be read: "
            f"{type(cause).__name__}: {cause} (a file cut short or damaged); nothing was "
            f"written to {args.out!r}",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
