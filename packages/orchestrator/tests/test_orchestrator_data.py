"""Prompt loading (files, chat template, overlong filter, errors) and the resumable loader.

The tokenizer is built here: one token per character plus <s> as BOS, so expected token ids
can be written down from the text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from patrl.orchestrator.data import PromptItem, PromptLoader, load_prompt_dataset, truncate

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!+-*/=<>|:\n'"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "<pad>": 2} | {c: i + 3 for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", unk_token="<unk>", pad_token="<pad>"
    )
    hf.chat_template = chat_template
    return hf


def _char_ids(text: str) -> list[int]:
    return [CHARS.index(c) + 3 for c in text]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [
    {"prompt": "What is 2+2?", "answer": "4", "source": "toy", "level": 1},
    {"prompt": "What is 3*3?", "answer": 9, "source": "toy", "level": 2},
    {"prompt": "Add 10 and 5.", "answer": "15", "source": "toy", "level": 1},
]


def test_raw_string_prompts_without_template(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", ROWS)
    ds = load_prompt_dataset(
        path, tokenizer=_tokenizer(None), max_prompt_length=64, cache_dir=str(tmp_path / "c")
    )
    assert len(ds) == 3 and ds.num_rows == 3 and ds.num_filtered_overlong == 0
    item = ds[1]
    assert item.index == 1
    assert item.prompt == "What is 3*3?"
    assert item.prompt_token_ids == [1, *_char_ids("What is 3*3?")]
    assert item.answer == "9"  # a number in the file becomes a string
    assert item.extra == {"source": "toy", "level": 2}


def test_chat_template_renders_messages_and_strings(tmp_path: Path) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": "Hi there"}], "answer": "1"},
        {"prompt": "What is 2+2?", "answer": "4"},
        {
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Why?"},
            ],
            "answer": "2",
        },
    ]
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    tok = _tokenizer(TEMPLATE)
    ds = load_prompt_dataset(
        path,
        tokenizer=tok,
        max_prompt_length=128,
        system_prompt="Answer in a box.",
        cache_dir=str(tmp_path / "c"),
    )
    assert [item.prompt for item in ds.items] == [
        "<|system|>Answer in a box.\n<|user|>Hi there\n<|assistant|>",
        "<|system|>Answer in a box.\n<|user|>What is 2+2?\n<|assistant|>",
        "<|system|>Be brief.\n<|user|>Why?\n<|assistant|>",  # its own system message stays
    ]
    for item in ds.items:  # the template's text, with no BOS added on top
        assert item.prompt_token_ids == _char_ids(item.prompt)
    # the same file with the template switched off: strings are used as they are
    raw = load_prompt_dataset(
        _jsonl(tmp_path / "plain.jsonl", [rows[1]]),
        tokenizer=tok,
        max_prompt_length=128,
        apply_chat_template=False,
        system_prompt="Sys.",
        cache_dir=str(tmp_path / "c"),
    )
    assert raw[0].prompt == "Sys.\n\nWhat is 2+2?"
    assert raw[0].prompt_token_ids == [1, *_char_ids("Sys.\n\nWhat is 2+2?")]
    with pytest.raises(ValueError, match=r"row 0: .*chat message list.*apply_chat_template is off"):
        load_prompt_dataset(
            path,
            tokenizer=tok,
            max_prompt_length=128,
            apply_chat_template=False,
            cache_dir=str(tmp_path / "c"),
        )
    with pytest.raises(ValueError, match=r"row 0: .*the tokenizer has no chat template"):
        load_prompt_dataset(
            path, tokenizer=_tokenizer(None), max_prompt_length=128, cache_dir=str(tmp_path / "c")
        )


def test_overlong_prompts_are_filtered_and_counted_or_rejected(tmp_path: Path) -> None:
    rows = [{"prompt": "x" * n, "answer": str(n)} for n in (3, 10, 4, 12, 9)]
    path = _jsonl(tmp_path / "lengths.jsonl", rows)
    # with BOS a prompt of n characters has n + 1 tokens: limit 10 keeps n <= 9
    ds = load_prompt_dataset(
        path, tokenizer=_tokenizer(None), max_prompt_length=10, cache_dir=str(tmp_path / "c")
    )
    assert ds.num_rows == 5 and ds.num_filtered_overlong == 2
    assert [item.index for item in ds.items] == [0, 2, 4]
    assert [item.answer for item in ds.items] == ["3", "4", "9"]
    with pytest.raises(
        ValueError, match=r"row 1: prompt has 11 tokens > max_prompt_length=10.*truncation"
    ):
        load_prompt_dataset(
            path,
            tokenizer=_tokenizer(None),
            max_prompt_length=10,
            filter_overlong_prompts=False,
            cache_dir=str(tmp_path / "c"),
        )


@pytest.mark.parametrize(
    ("mode", "kept"),
    [
        ("left", "abcdefghij"),  # the first token (BOS) goes, the end stays
        ("right", "<s>abcdefghi"),
        ("middle", "<s>abcdfghij"),  # the first 5 and the last 5 tokens
    ],
)
def test_overlong_prompts_are_cut_as_verl_truncates(tmp_path: Path, mode: str, kept: str) -> None:
    path = _jsonl(tmp_path / "long.jsonl", [{"prompt": "abcdefghij", "answer": "1"}])
    ds = load_prompt_dataset(
        path,
        tokenizer=_tokenizer(None),
        max_prompt_length=10,  # the prompt is 11 tokens with BOS
        filter_overlong_prompts=False,
        truncation=mode,  # type: ignore[arg-type]
        cache_dir=str(tmp_path / "c"),
    )
    expected = [1] if kept.startswith("<s>") else []
    expected += _char_ids(kept.removeprefix("<s>"))
    assert ds[0].prompt_token_ids == expected and len(expected) == 10
    assert ds.num_filtered_overlong == 0


def test_truncate_is_verls_rule() -> None:
    """The slow twin: verl's postprocess_data slices, written out for every length."""
    ids = list(range(13))
    for length in range(1, 14):
        assert truncate(ids, length, "left") == ids[-length:]
        assert truncate(ids, length, "right") == ids[:length]
        head = length // 2
        assert truncate(ids, length, "middle") == ids[:head] + ids[-(length - head) :]
    assert truncate([1, 2], 5, "middle") == [1, 2]


def test_an_unset_answer_key_finds_patrls_or_verls_column(tmp_path: Path) -> None:
    import datasets

    verl_rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "Sum 1 2"}],
            "reward_model": {"style": "rule", "ground_truth": "3"},
            "extra_info": {"split": "train", "index": 0},
        }
    ]
    parquet = str(tmp_path / "verl.parquet")
    datasets.Dataset.from_list(verl_rows).to_parquet(parquet)
    kw: dict[str, Any] = {"max_prompt_length": 64, "cache_dir": str(tmp_path / "c")}
    verl = load_prompt_dataset(parquet, answer_key=None, tokenizer=_tokenizer(TEMPLATE), **kw)
    assert verl[0].answer == "3"
    own = load_prompt_dataset(
        _jsonl(tmp_path / "own.jsonl", ROWS), answer_key=None, tokenizer=_tokenizer(None), **kw
    )
    assert [item.answer for item in own.items] == ["4", "9", "15"]
    bare = _jsonl(tmp_path / "bare.jsonl", [{"prompt": "a", "meta": {"gold": "1", "n": 2}}])
    with pytest.raises(KeyError) as info:
        load_prompt_dataset(bare, answer_key=None, tokenizer=_tokenizer(None), **kw)
    message = info.value.args[0]
    assert "no answer column" in message and "'answer' or 'reward_model.ground_truth'" in message
    assert "['prompt', 'meta.gold', 'meta.n']" in message


def test_parquet_json_and_several_files(tmp_path: Path) -> None:
    import datasets

    verl_style = [
        {
            "prompt": [{"role": "user", "content": "Sum 1 2"}],
            "reward_model": {"ground_truth": "3", "style": "rule"},
            "data_source": "toy",
        }
    ]
    parquet = str(tmp_path / "verl.parquet")
    datasets.Dataset.from_list(verl_style).to_parquet(parquet)
    json_path = tmp_path / "more.json"
    json_path.write_text(json.dumps([{"prompt": [{"role": "user", "content": "Hi"}], "gt": 5}]))
    ds = load_prompt_dataset(
        parquet,
        answer_key="reward_model.ground_truth",
        tokenizer=_tokenizer(TEMPLATE),
        max_prompt_length=64,
        cache_dir=str(tmp_path / "c"),
    )
    assert ds[0].answer == "3"
    assert ds[0].prompt == "<|user|>Sum 1 2\n<|assistant|>"
    assert ds[0].extra == {
        "reward_model": {"ground_truth": "3", "style": "rule"},
        "data_source": "toy",
    }
    two = load_prompt_dataset(
        [_jsonl(tmp_path / "a.jsonl", ROWS), _jsonl(tmp_path / "b.jsonl", ROWS[:2])],
        tokenizer=_tokenizer(None),
        max_prompt_length=64,
        cache_dir=str(tmp_path / "c"),
    )
    assert [item.index for item in two.items] == [0, 1, 2, 3, 4]
    assert [item.answer for item in two.items] == ["4", "9", "15", "4", "9"]
    single_json = load_prompt_dataset(
        str(json_path),
        answer_key="gt",
        tokenizer=_tokenizer(TEMPLATE),
        max_prompt_length=64,
        cache_dir=str(tmp_path / "c"),
    )
    assert single_json[0].answer == "5"


def test_data_errors_name_what_is_wrong(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", ROWS)
    kw: dict[str, Any] = {
        "tokenizer": _tokenizer(None),
        "max_prompt_length": 64,
        "cache_dir": str(tmp_path / "c"),
    }
    with pytest.raises(
        KeyError,
        match=r"prompt column 'question' not found.*\['prompt', 'answer', 'source', 'level'\]",
    ):
        load_prompt_dataset(path, prompt_key="question", **kw)
    with pytest.raises(KeyError, match=r"answer column 'solution' not found"):
        load_prompt_dataset(path, answer_key="solution", **kw)
    nested = _jsonl(
        tmp_path / "nested.jsonl", [{"prompt": "a", "reward_model": {"ground_truth": "1"}}]
    )
    with pytest.raises(KeyError, match=r"\['prompt', 'reward_model.ground_truth'\]"):
        load_prompt_dataset(nested, answer_key="reward_model.answer", **kw)
    with pytest.raises(FileNotFoundError, match=r"missing.jsonl' does not exist"):
        load_prompt_dataset(str(tmp_path / "missing.jsonl"), **kw)
    bad = tmp_path / "rows.csv"
    bad.write_text("prompt,answer\nhi,1\n")
    with pytest.raises(ValueError, match=r"extension '.csv'; accepted: .jsonl, .json, .parquet"):
        load_prompt_dataset(str(bad), **kw)
    with pytest.raises(ValueError, match=r"row 0: answer 'answer' is None"):
        load_prompt_dataset(
            _jsonl(tmp_path / "none.jsonl", [{"prompt": "a", "answer": None}]), **kw
        )
    with pytest.raises(ValueError, match=r"row 0: prompt must be a string or a non-empty list"):
        load_prompt_dataset(
            _jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"text": "a"}], "answer": "1"}]),
            tokenizer=_tokenizer(TEMPLATE),
            max_prompt_length=64,
            cache_dir=str(tmp_path / "c"),
        )


def _items(n: int) -> list[PromptItem]:
    return [PromptItem(i, [i], f"p{i}", str(i)) for i in range(n)]


def _indices(batch: list[PromptItem]) -> list[int]:
    return [item.index for item in batch]


@pytest.mark.parametrize("drop_last", [True, False])
def test_loader_resume_draws_the_same_batches(drop_last: bool) -> None:
    items = _items(10)
    uninterrupted = PromptLoader(items, 3, seed=7, drop_last=drop_last)
    expected = [_indices(uninterrupted.next_batch()) for _ in range(12)]
    for stop in (1, 3, 4, 7):
        first = PromptLoader(items, 3, seed=7, drop_last=drop_last)
        drawn = [_indices(first.next_batch()) for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
        resumed = PromptLoader(items, 3, seed=7, drop_last=drop_last)
        resumed.load_state_dict(state)
        drawn += [_indices(resumed.next_batch()) for _ in range(12 - stop)]
        assert drawn == expected, stop


def test_loader_epochs_are_seeded_permutations() -> None:
    items = _items(10)
    loader = PromptLoader(items, 4, seed=3, drop_last=True)
    # drop_last: two batches of 4 per epoch, the last 2 of each permutation are skipped
    epoch0 = _indices(loader.next_batch()) + _indices(loader.next_batch())
    epoch1 = _indices(loader.next_batch()) + _indices(loader.next_batch())
    assert loader.epoch == 1
    assert epoch0 == loader.order(0)[:8].tolist() and epoch1 == loader.order(1)[:8].tolist()
    assert sorted(loader.order(0).tolist()) == list(range(10)) and epoch0 != epoch1
    # without drop_last every item appears exactly once per epoch, the last batch is short
    keep = PromptLoader(items, 4, seed=3, drop_last=False)
    batches = [_indices(keep.next_batch()) for _ in range(3)]
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert keep.next_batch() == [items[i] for i in keep.order(1)[:4].tolist()]
    # seeds decide the order; no shuffle is file order
    assert PromptLoader(items, 4, seed=4).order(0).tolist() != loader.order(0).tolist()
    plain = PromptLoader(items, 4, shuffle=False)
    assert _indices(plain.next_batch()) == [0, 1, 2, 3]


def test_loader_errors() -> None:
    with pytest.raises(ValueError, match="batch_size=5 > 4 prompts with drop_last"):
        PromptLoader(_items(4), 5)
    with pytest.raises(ValueError, match="dataset is empty"):
        PromptLoader([], 1)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        PromptLoader(_items(4), 0)
    state = PromptLoader(_items(4), 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="loader state has seed=1 but this loader has 2"):
        PromptLoader(_items(4), 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_items=4 but this loader has 5"):
        PromptLoader(_items(5), 2, seed=1).load_state_dict(state)


def test_max_samples_keeps_verls_rows_with_their_indices(tmp_path: Path) -> None:
    """verl's `data.train_max_samples` / `val_max_samples`: the first N rows without shuffle,
    else N distinct rows drawn by default_rng(seed) (numpy's stream: a seed picks the same
    rows in verl and here), before the length filter; a kept row keeps its index."""
    from patrl.orchestrator.data import sample_rows

    assert sample_rows(10, -1, 0) == list(range(10))
    assert sample_rows(10, 10, 0) == sample_rows(10, 99, 0) == list(range(10))
    assert sample_rows(10, 3, None) == [0, 1, 2]
    drawn = sample_rows(10, 4, 7)
    assert drawn == sample_rows(10, 4, 7) != sample_rows(10, 4, 8)
    assert len(set(drawn)) == 4 and all(0 <= i < 10 for i in drawn)
    # verl's RLHFDataset draws np.random.default_rng(seed).choice(total, size, replace=False)
    assert drawn == np.random.default_rng(7).choice(10, size=4, replace=False).tolist()

    rows = [{"prompt": "x" * n, "answer": str(n)} for n in (3, 10, 4, 12, 9, 5)]
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    kw: dict[str, Any] = dict(tokenizer=_tokenizer(None), max_prompt_length=10)
    first = load_prompt_dataset(path, max_samples=3, **kw)
    assert [i.index for i in first.items] == [0, 2]  # row 1 (11 tokens) filtered after
    assert first.num_rows == 3 and first.num_filtered_overlong == 1
    picked = sample_rows(6, 3, 5)
    shuffled = load_prompt_dataset(path, max_samples=3, sample_seed=5, **kw)
    kept = [i for i in picked if len(rows[i]["prompt"]) <= 9]
    assert [i.index for i in shuffled.items] == kept
    assert [i.answer for i in shuffled.items] == [rows[i]["answer"] for i in kept]
