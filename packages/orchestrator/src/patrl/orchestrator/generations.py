"""verl's generation dumps: with `trainer.rollout_data_dir` each training step's responses, and
with `trainer.validation_data_dir` each validation's, go to `<dir>/<step>.jsonl`, one line per
response with verl's columns: `input` (the prompt's text as the engine saw it, chat template
and, multi-turn, tool schemas included), `output` (the response's text, tool turns included:
what the reward read), `gts` (the answer), `score` (the reward), `step`, and each numeric entry
a reward function returned beside its score (verl's `reward_extra_info`, named as validation's
metrics name them), plus `data_source` where the row has one.

A file is written whole or not at all (staged, then renamed), so a crash never leaves half a
step; a rerun of a step (a resume) replaces its file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.scoring import Sample
from patrl.orchestrator.val_metrics import variables


def generation_rows(
    samples: Sequence[Sample], items: Mapping[int, PromptItem], tokenizer: Any, step: int
) -> list[dict[str, Any]]:
    """One row per sample (see the module docstring); `items`: prompt index -> its row."""
    inputs = tokenizer.batch_decode([s.prompt_token_ids for s in samples], skip_special_tokens=True)
    outputs = tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
    rows = []
    for s, text_in, text_out, extras in zip(
        samples, inputs, outputs, variables(samples), strict=True
    ):
        item = items[s.prompt_index]
        row: dict[str, Any] = {
            "input": text_in,
            "output": text_out,
            "gts": item.answer,
            "score": s.reward,
            "step": step,
        }
        row.update((k, v) for k, v in extras.items() if k != "reward")
        source = item.extra.get("data_source")
        if source:
            row["data_source"] = str(source)
        rows.append(row)
    return rows


def dump_generations(directory: str | Path, step: int, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write `rows` to `<directory>/<step>.jsonl` (made if missing), whole or not at all."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step}.jsonl"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(dict(r), ensure_ascii=False) + "\n" for r in rows)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
