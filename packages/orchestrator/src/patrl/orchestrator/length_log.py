"""The run's length log, `<run_dir>/lengths.jsonl`: every generated training sample's prompt,
length and finish reason, one line each, in the format `python -m patrl.lenpredict.simulate`
reads as is (`patrl.lenpredict.length_trace`).

A step appends its rollout(s) with one write. A resumed run redoes steps after its checkpoint:
the first write of a step at or before the last one logged (or after a crash left a line
half-written) first rewrites the file without those rows, staged beside it and renamed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from patrl.lenpredict import LengthRecord

LENGTH_LOG = "lengths.jsonl"
_TAIL_BYTES = 1 << 16


class _Sample(Protocol):
    @property
    def prompt_index(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> str: ...


def length_records(step: int, samples: Sequence[_Sample], round_: int = 0) -> list[LengthRecord]:
    """One record per sample with a token (an empty response has nothing to simulate): a
    prompt's samples numbered 0.. in the order given."""
    seen: dict[int, int] = {}
    records = []
    for s in samples:
        if not s.token_ids:
            continue
        index = seen.get(s.prompt_index, 0)
        seen[s.prompt_index] = index + 1
        records.append(
            LengthRecord(
                step=step,
                round=round_,
                prompt_id=str(s.prompt_index),
                sample=index,
                prompt_tokens=len(s.prompt_token_ids),
                response_tokens=len(s.token_ids),
                finish_reason=s.finish_reason,
            )
        )
    return records


def append_lengths(run_dir: Path, step: int, samples: Sequence[_Sample], round_: int = 0) -> Path:
    """Append rollout (`step`, `round_`)'s samples to the run's length log; rows of it or of
    later rollouts already there (a resumed run redoing them) are dropped first."""
    path = Path(run_dir) / LENGTH_LOG
    records = length_records(step, samples, round_)
    if not records:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and _must_rewrite(path, (step, round_)):
        _rewrite_before(path, (step, round_))
    with path.open("a") as f:
        f.write("".join(r.model_dump_json(exclude_none=True) + "\n" for r in records))
    return path


def _must_rewrite(path: Path, rollout: tuple[int, int]) -> bool:
    """Whether the log ends in a half-written line or at a rollout not before `rollout`."""
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return False
        f.seek(max(0, size - _TAIL_BYTES))
        tail = f.read()
    if not tail.endswith(b"\n"):
        return True
    last = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        row = json.loads(last)
        return (int(row.get("step", 0)), int(row.get("round", 0))) >= rollout
    except (ValueError, TypeError):
        return True


def _rewrite_before(path: Path, rollout: tuple[int, int]) -> None:
    """Keep only the complete rows of rollouts before `rollout`; stage, then rename."""
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        if not line.endswith("\n"):
            continue  # the half-written last line of a crash
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if (int(row.get("step", 0)), int(row.get("round", 0))) < rollout:
            kept.append(line)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(kept))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
