"""Preference pairs: rows of (prompt, chosen, rejected) from .jsonl or .parquet files, checked
and tokenized for the Bradley-Terry trainer.

A prompt is a string or a chat message list; chosen and rejected are response strings. With a
tokenizer that has a chat template, a pair is the prompt's messages plus the response as the
assistant turn, rendered by the template; otherwise prompt text + response text. Sequences
longer than `max_length` keep their last `max_length` tokens (the scored token is the last).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = (".jsonl", ".parquet")


@dataclass(frozen=True, slots=True)
class PreferenceKeys:
    """The column names of a preference file."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"


Pair = tuple[list[int], list[int]]  # (chosen ids, rejected ids)


def read_preferences(
    files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    keys: PreferenceKeys = PreferenceKeys(),
) -> list[dict[str, Any]]:
    """Every row of the files, in order; ValueError naming the file, row and key of a row
    that lacks one of `keys` or holds a wrong type."""
    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not paths:
        raise ValueError("no preference files given")
    rows: list[dict[str, Any]] = []
    for path in paths:
        part = _read(Path(path))
        for i, row in enumerate(part):
            check_row(row, i, str(path), keys)
        rows += part
    return rows


def check_row(row: dict[str, Any], index: int, path: str, keys: PreferenceKeys) -> None:
    """Raise unless `row` has a prompt (string or messages) and string chosen/rejected."""
    for role in ("prompt", "chosen", "rejected"):
        key = getattr(keys, role)
        if key not in row:
            raise ValueError(
                f"preference file {path!r} row {index}: no {role} key {key!r} (columns: "
                f"{sorted(row)}); each row needs {keys.prompt!r}, {keys.chosen!r} and "
                f"{keys.rejected!r}"
            )
        value = row[key]
        ok = isinstance(value, str) or (role == "prompt" and isinstance(value, list) and value)
        if not ok:
            raise ValueError(
                f"preference file {path!r} row {index}: {key!r} is {type(value).__name__} "
                f"{value!r:.80}; need a string" + (" or a message list" if role == "prompt" else "")
            )


def _read(path: Path) -> list[dict[str, Any]]:
    if path.suffix not in FORMATS:
        raise ValueError(
            f"preference file {str(path)!r}: extension {path.suffix!r}; accepted: {FORMATS}"
        )
    if not path.is_file():
        raise ValueError(f"preference file {str(path)!r} does not exist")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError(
                f"preference file {str(path)!r}: parquet needs pyarrow: "
                "pip install 'patrl-trainer[parquet]'"
            ) from err

        return list(pq.read_table(path).to_pylist())
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"preference file {str(path)!r} line {n}: not JSON: {err}"
                ) from None
    if not rows:
        raise ValueError(f"preference file {str(path)!r} has no rows")
    return rows


def tokenize_pairs(
    rows: Sequence[dict[str, Any]],
    tokenizer: Any,
    max_length: int,
    keys: PreferenceKeys = PreferenceKeys(),
) -> list[Pair]:
    """Each row as (chosen ids, rejected ids), see the module for the rendering."""
    return [
        (
            encode_response(row[keys.prompt], row[keys.chosen], tokenizer, max_length),
            encode_response(row[keys.prompt], row[keys.rejected], tokenizer, max_length),
        )
        for row in rows
    ]


def encode_response(prompt: Any, response: str, tokenizer: Any, max_length: int) -> list[int]:
    """One (prompt, response) as token ids, at most `max_length` of them (the last ones)."""
    if getattr(tokenizer, "chat_template", None):
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )
        chat = [*messages, {"role": "assistant", "content": response}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        if not isinstance(prompt, str):
            raise ValueError("a message-list prompt needs a tokenizer with a chat template")
        ids = tokenizer(prompt + response)["input_ids"]
    return list(ids[-max_length:])
