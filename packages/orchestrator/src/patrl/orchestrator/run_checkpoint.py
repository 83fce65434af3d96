"""Run checkpoints: trainer state + loop state, written whole or not at all.

Layout: `<run_dir>/global_step_<N>/{trainer/, huggingface/, critic/ (gae), state.json}` (the
run dir is `trainer.default_local_dir`, verl's checkpoint folder), built in
`global_step_<N>.tmp/` and renamed when complete: `latest_checkpoint` (`resume_mode=auto`) never
sees a half-written one, and a crash's `.tmp` is ignored and cleared on the next save.
`huggingface/` is the policy as a Hugging Face directory (its weights when
`actor.checkpoint.save_contents` has hf_model; config, generation config and tokenizer always),
`critic/huggingface/` the critic's likewise. `check_resumable` compares a checkpoint with the
model at hand from metadata alone (DCP's `.metadata`, the trainer's marker), before anything is
built; the world size may differ from the one that saved it (DCP reshards on load).
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patrl.trainer.checkpoint import MARKER, read_marker
from patrl.trainer.config import RESUMABLE_CONTENTS
from patrl.trainer.export import HF_DIR, RUN_POLICY_DIR

STATE_FILE = "state.json"
# Every file of a checkpoint and its size, written just before STATE_FILE (which completes it).
MANIFEST_FILE = "manifest.json"
TRAINER_DIR = RUN_POLICY_DIR
CRITIC_DIR = "critic"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Architecture facts readable from tensor shapes: (what, tensor, dim).
_SHAPE_FACTS = (
    ("vocab_size", "model.embed_tokens.weight", 0),
    ("hidden_size", "model.embed_tokens.weight", 1),
    ("intermediate_size", "model.layers.0.mlp.gate_proj.weight", 0),
    ("num_attention_heads*head_dim", "model.layers.0.self_attn.q_proj.weight", 0),
    ("num_key_value_heads*head_dim", "model.layers.0.self_attn.k_proj.weight", 0),
)


def checkpoint_root(run_dir: Path) -> Path:
    """The folder holding the run's `global_step_<N>` checkpoints: the run dir itself."""
    return run_dir


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"global_step_{step}"


def hf_dir(checkpoint: Path) -> Path:
    """The policy's Hugging Face directory in a run checkpoint (its critic's is
    `checkpoint / CRITIC_DIR / HF_DIR`)."""
    return checkpoint / HF_DIR


def staging_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"global_step_{step}.tmp"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None
    complete = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / STATE_FILE).is_file():
            complete.append((int(match.group(1)), path))
    return max(complete)[1] if complete else None


def prepare_staging(run_dir: Path, step: int) -> Path:
    """An empty staging directory for step `step` (rank 0 calls this, then all ranks write)."""
    staging = staging_dir(run_dir, step)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write the manifest and the loop state, and publish the staged checkpoint (rank 0, after
    all ranks wrote)."""
    staging = staging_dir(run_dir, step)
    write_manifest(staging)
    tmp = staging / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.rename(staging / STATE_FILE)
    final = step_dir(run_dir, step)
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    _prune(run_dir, keep)
    return final


def write_manifest(staging: Path) -> None:
    """Record the size of every file under `staging` (paths relative to it), so that a reader
    can tell a sound checkpoint from one whose files were cut short or lost since."""
    files = {
        str(path.relative_to(staging)): path.stat().st_size
        for path in sorted(staging.rglob("*"))
        if path.is_file() and path.name not in (STATE_FILE, MANIFEST_FILE)
    }
    tmp = staging / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps({"files": files}, indent=0))
    tmp.rename(staging / MANIFEST_FILE)


def damage(checkpoint: Path) -> list[str]:
    """How `checkpoint`'s files differ from its manifest (missing, or of another size), each
    named; empty when they agree, or for a checkpoint written before manifests existed."""
    manifest = checkpoint / MANIFEST_FILE
    if not manifest.is_file():
        return []
    try:
        files: dict[str, int] = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as err:
        return [f"{manifest} is unreadable ({err})"]
    problems = []
    for name, size in files.items():
        path = checkpoint / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif (actual := path.stat().st_size) != size:
            problems.append(f"{path} is {actual} bytes, its manifest says {size}")
    return problems


def check_sound(checkpoint: Path) -> None:
    """Raise ValueError naming the damaged files of `checkpoint` and the ways out."""
    problems = damage(checkpoint)
    if problems:
        others = [
            str(p)
            for p in sorted(checkpoint.parent.glob("global_step_*"))
            if p != checkpoint and _STEP_DIR.match(p.name)
        ]
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} is damaged: {'; '.join(problems[:3])} (a save cut "
            "short, or files changed since). Resume another checkpoint "
            f"(trainer.resume_from_path; here: {others or 'none'}), or start afresh "
            "(trainer.resume_mode=disable)"
        )


def sound_checkpoint(run_dir: Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete checkpoint whose files match its manifest; each newer damaged one
    is skipped, with `warn` told which and why."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None
    complete = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()
    )
    for _, path in reversed(complete):
        problems = damage(path)
        if not problems:
            return path
        if warn is not None:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            warn(
                f"checkpoint {path} is damaged: {problems[0]}{more}; resuming from the newest "
                "sound one before it"
            )
    return None


def resume_target(
    run_dir: Path,
    resume_mode: str,
    resume_from_path: str | None,
    warn: Callable[[str], None] | None = None,
) -> Path | None:
    """The checkpoint a run with these `trainer.resume_*` settings resumes from, or None:
    `resume_from_path` as given (check_resumable judges it), else the newest sound one."""
    if resume_mode == "disable":
        return None
    if resume_mode == "resume_path" and resume_from_path:
        return Path(resume_from_path)
    return sound_checkpoint(run_dir, warn)


def check_resumable(
    checkpoint: Path, shapes: dict[str, tuple[int, ...]], optional: set[str]
) -> None:
    """Raise ValueError unless `checkpoint` is complete, holds everything a resume needs and
    a policy with exactly these tensor `shapes` (HF names; `optional` may be absent). Any
    number of trainer ranks may resume it."""
    trainer = checkpoint / TRAINER_DIR
    if not (checkpoint / STATE_FILE).is_file() or not (trainer / MARKER).is_file():
        raise ValueError(
            f"{str(checkpoint)!r} is not a complete patrl checkpoint (it needs {STATE_FILE} and "
            f"{TRAINER_DIR}/{MARKER}); complete ones are the global_step_<N> directories "
            "of the run directory"
        )
    check_sound(checkpoint)
    for part, key in ((TRAINER_DIR, "actor"), (CRITIC_DIR, "critic")):
        if (checkpoint / part / MARKER).is_file():
            contents = read_marker(checkpoint / part)["contents"]
            if not all(c in contents for c in RESUMABLE_CONTENTS):
                raise ValueError(
                    f"checkpoint {str(checkpoint)!r} cannot be resumed: its {part}/ was saved "
                    f"with {key}.checkpoint.save_contents={contents}, and resuming needs "
                    f"{list(RESUMABLE_CONTENTS)}; resume another checkpoint or start afresh "
                    "(trainer.resume_mode=disable)"
                )
    differences = compare_shapes(saved_shapes(checkpoint), shapes, optional)
    if differences:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} holds a different model than model.path: "
            + "; ".join(differences)
        )


def saved_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every policy tensor in a checkpoint, from DCP's metadata alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(checkpoint / TRAINER_DIR)).read_metadata()
    return {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }


def compare_shapes(
    saved: dict[str, tuple[int, ...]], model: dict[str, tuple[int, ...]], optional: set[str]
) -> list[str]:
    """What differs between a checkpoint's tensors and a model's, architecture facts first,
    then the first tensor of each kind of mismatch; empty when they agree."""
    facts = [
        f"{what} is {a} in the checkpoint, {b} in the model"
        for what, a, b in zip(
            ("num_hidden_layers", *(f[0] for f in _SHAPE_FACTS)),
            _facts(saved),
            _facts(model),
            strict=True,
        )
        if a is not None and b is not None and a != b
    ]
    shaped = [n for n in sorted(saved.keys() & model.keys()) if saved[n] != model[n]]
    only_saved = sorted(saved.keys() - model.keys() - optional)
    only_model = sorted(model.keys() - saved.keys() - optional)
    if shaped:
        facts.append(
            f"tensor {shaped[0]!r} is {list(saved[shaped[0]])} in the checkpoint, "
            f"{list(model[shaped[0]])} in the model ({len(shaped)} tensors differ in shape)"
        )
    if only_saved:
        facts.append(f"{len(only_saved)} tensors only in the checkpoint, e.g. {only_saved[:3]}")
    if only_model:
        facts.append(f"{len(only_model)} tensors only in the model, e.g. {only_model[:3]}")
    return facts


def _facts(shapes: dict[str, tuple[int, ...]]) -> list[int | None]:
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    sized = [
        shapes[name][dim] if name in shapes and len(shapes[name]) > dim else None
        for _, name, dim in _SHAPE_FACTS
    ]
    return [len(layers), *sized]


def read_state(checkpoint: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((checkpoint / STATE_FILE).read_text())
    return state


def _prune(run_dir: Path, keep: int) -> None:
    root = checkpoint_root(run_dir)
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
    for _, path in steps[:-keep]:
        shutil.rmtree(path)
    for path in root.glob("global_step_*.tmp"):  # a crashed save's staging
        shutil.rmtree(path)


# What a write to a full filesystem raises, when the OS error itself was not kept: torch's zip
# writer reports a short write as a position mismatch.
_SHORT_WRITE = ("unexpected pos", "No space left on device", "Disk quota exceeded")


def disk_full(err: BaseException, path: Path, needed: int) -> str | None:
    """ "no space left on device ..." with the numbers, when `err` (or what it wraps, DCP's
    per-rank failures included) is a write that ran out of space at `path`; else None. A short
    write with space to spare (another I/O error) is not called a full disk."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> error
        if isinstance(failures, dict):  # (the error, its stack) per failed rank
            for f in failures.values():
                first = f[0] if isinstance(f, tuple) and f else f
                todo += [first] if isinstance(first, BaseException) else []
    enospc = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in seen)
    short = any(any(sign in str(e) for sign in _SHORT_WRITE) for e in seen)
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if not enospc and not (short and free < needed):
        return None
    return (
        f"no space left on device: {where} has {free / 2**20:.1f} MiB free and a checkpoint "
        f"needs about {needed / 2**20:.1f} MiB"
    )
