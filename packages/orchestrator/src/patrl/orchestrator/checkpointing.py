"""Run checkpoints: trainer state + loop state, written whole or not at all.

Layout: `<run_dir>/checkpoints/global_step_<N>/{trainer/, state.json}`. A checkpoint is built
in `global_step_<N>.tmp/` and renamed when complete, so `latest_checkpoint` (what
`trainer.resume_mode=auto` uses) never sees a half-written one: a crash leaves only a `.tmp`
directory, which is ignored and cleared on the next save.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"global_step_{step}"


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
    """Write the loop state and publish the staged checkpoint (rank 0, after all ranks wrote)."""
    staging = staging_dir(run_dir, step)
    tmp = staging / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.rename(staging / STATE_FILE)
    final = step_dir(run_dir, step)
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    _prune(run_dir, keep)
    return final


def read_state(checkpoint: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((checkpoint / STATE_FILE).read_text())
    return state


def _prune(run_dir: Path, keep: int) -> None:
    root = checkpoint_root(run_dir)
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
    for _, path in steps[:-keep]:
        shutil.rmtree(path)
    for path in root.glob("*.tmp"):
        shutil.rmtree(path)
