"""verl's generation dumps (`trainer.rollout_data_dir`, `trainer.validation_data_dir`): the
rows' columns and texts, and files written whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agent_scripted import hermes_tokenizer

from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.generations import dump_generations, generation_rows
from patrl.orchestrator.scoring import Sample


def test_rows_hold_verls_columns_the_decoded_texts_and_the_reward_extras() -> None:
    tok = hermes_tokenizer()
    prompt = tok.encode("<|im_start|>user\n2+2?<|im_end|>\n")
    items = {
        3: PromptItem(3, prompt, "2+2?", "4", {"data_source": "sums"}),
        5: PromptItem(5, prompt, "2+2?", "4"),
    }
    extras = {"f/acc": 1.0}
    samples = [
        Sample(3, prompt, tok.encode("4<|im_end|>"), [-0.1, -0.2], "stop", 1.0, extras=extras),
        Sample(5, prompt, tok.encode("5"), [-0.3], "length", 0.0),
    ]
    rows = generation_rows(samples, items, tok, step=7)
    assert rows == [
        {
            "input": "user\n2+2?\n",  # special tokens skipped, as verl decodes
            "output": "4",
            "gts": "4",
            "score": 1.0,
            "step": 7,
            "acc": 1.0,
            "data_source": "sums",
        },
        {"input": "user\n2+2?\n", "output": "5", "gts": "4", "score": 0.0, "step": 7},
    ]


def test_a_dump_is_written_whole_or_not_at_all_and_a_rerun_replaces_it(tmp_path: Path) -> None:
    folder = tmp_path / "dumps"
    path = dump_generations(folder, 2, [{"output": "a", "score": 1.0}, {"output": "é"}])
    assert path == folder / "2.jsonl"
    assert [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()] == [
        {"output": "a", "score": 1.0},
        {"output": "é"},
    ]
    with pytest.raises(TypeError):  # a value JSON cannot write: nothing replaces the file
        dump_generations(folder, 2, [{"output": "b"}, {"output": object()}])
    assert json.loads(path.read_text().splitlines()[0]) == {"output": "a", "score": 1.0}
    assert sorted(p.name for p in folder.iterdir()) == ["2.jsonl"]  # no staged file left
    dump_generations(folder, 2, [{"output": "c"}])
    assert path.read_text() == '{"output": "c"}\n'
