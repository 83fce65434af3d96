"""Prompt datasets: files -> tokenized prompts with answers, and a resumable batch loader.

Rows come from local .jsonl / .json / .parquet files (the standard library's json, pyarrow),
or from a hub dataset id when the name is not a local path (`datasets`). A prompt is a string or a chat message list
([{"role": ..., "content": ...}]). With `apply_chat_template` and a tokenizer that has a chat
template, the prompt (a string becomes one user message) is rendered with
`add_generation_prompt=True` and tokenized without adding special tokens again (the template
already holds them); otherwise the string itself is tokenized with the tokenizer's special
tokens. Prompts longer than `max_prompt_length` tokens are dropped and counted, or (verl's
`data.truncation`) rejected or cut. The gold answer is a column, dotted into struct columns;
unnamed, it is `answer`, else verl's `reward_model.ground_truth`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from patrl.orchestrator.config import JobConfig

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# The answer column looked for when data.answer_key is unset: patrl's, then verl's layout.
DEFAULT_ANSWER_KEYS = ("answer", "reward_model.ground_truth")
Truncation = Literal["error", "left", "right", "middle"]


@dataclass(frozen=True, slots=True)
class PromptItem:
    """One prompt. `index` is its row in the files as read (before filtering), stable across
    runs, so per-prompt history (response lengths, rewards) can be keyed by it."""

    index: int
    prompt_token_ids: list[int]
    prompt: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)
    # the prompt as chat messages (a string: one user turn), for a reward model's own template
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class PromptDataset:
    """The prompts that passed the length filter, and how many did not."""

    items: list[PromptItem]
    num_rows: int
    num_filtered_overlong: int

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


def load_prompt_dataset(
    files: list[str] | str,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    tokenizer: Any,
    max_prompt_length: int,
    filter_overlong_prompts: bool = True,
    truncation: Truncation = "error",
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    split: str = "train",
    cache_dir: str | None = None,
    max_samples: int = -1,
    sample_seed: int | None = None,
) -> PromptDataset:
    """Read, render and tokenize every row. `answer_key` may be dotted to reach into a struct
    column (verl's parquet files keep the answer in `reward_model.ground_truth`); None takes
    the first of `DEFAULT_ANSWER_KEYS` that the first file has. An overlong prompt is dropped
    (`filter_overlong_prompts`), else rejected or cut as `truncation` says. With
    `0 < max_samples < rows`, only `max_samples` rows are kept before anything else (verl's
    `data.train_max_samples`): drawn without replacement by numpy's default_rng(`sample_seed`),
    or the first ones with `sample_seed` None; a kept row keeps its index."""
    paths = [files] if isinstance(files, str) else list(files)
    if not paths:
        raise ValueError("no data files given")
    rows: list[dict[str, Any]] = []
    for path in paths:
        part = read_rows(path, split=split, cache_dir=cache_dir)
        if answer_key is None:
            answer_key = default_answer_key(path, part)
        check_columns(path, part, {"prompt": prompt_key, "answer": answer_key})
        rows += part
    assert answer_key is not None  # the first file's, when unset
    picked = sample_rows(len(rows), max_samples, sample_seed)
    rows = [rows[i] for i in picked]
    use_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
    texts = [
        render_prompt(row[prompt_key], i, tokenizer, use_template, system_prompt)
        for i, row in zip(picked, rows, strict=True)
    ]
    token_ids = tokenizer(texts, add_special_tokens=not use_template)["input_ids"] if texts else []
    items, num_overlong = [], 0
    for i, row, text, ids in zip(picked, rows, texts, token_ids, strict=True):
        if len(ids) > max_prompt_length:
            if filter_overlong_prompts:
                num_overlong += 1
                continue
            if truncation == "error":
                raise ValueError(
                    f"row {i}: prompt has {len(ids)} tokens > max_prompt_length="
                    f"{max_prompt_length} (set filter_overlong_prompts to drop such rows, or "
                    "data.truncation=left/right/middle to cut them)"
                )
            ids = truncate(list(ids), max_prompt_length, truncation)
        extra = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        messages = prompt_messages(row[prompt_key], i, system_prompt)
        items.append(PromptItem(i, list(ids), text, _answer(row, answer_key, i), extra, messages))
    if not items:
        shortest = min(len(ids) for ids in token_ids)
        raise ValueError(
            f"no prompts left in {files!r}: all {len(rows)} rows were filtered as overlong, "
            f"their prompts have {shortest} tokens or more > data.max_prompt_length="
            f"{max_prompt_length}; raise data.max_prompt_length to at least {shortest}"
        )
    return PromptDataset(items, num_rows=len(rows), num_filtered_overlong=num_overlong)


def sample_rows(total: int, max_samples: int, seed: int | None) -> list[int]:
    """The row positions `load_prompt_dataset` keeps of `total`, in the order verl's dataset
    keeps them: all when `max_samples` <= 0 or >= total; else `max_samples` of them drawn by
    `np.random.default_rng(seed).choice` (verl's shuffled `max_samples`), or the first ones
    when `seed` is None (verl with `data.shuffle=false`)."""
    if max_samples <= 0 or max_samples >= total:
        return list(range(total))
    if seed is None:
        return list(range(max_samples))
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(total, size=max_samples, replace=False)]


def truncate(ids: list[int], length: int, mode: Truncation) -> list[int]:
    """`ids` cut to `length` tokens as verl cuts: keeping the end (left), the start (right), or
    the first length // 2 and the last length - length // 2 tokens (middle)."""
    if len(ids) <= length:
        return ids
    if mode == "left":
        return ids[-length:]
    if mode == "right":
        return ids[:length]
    if mode == "middle":
        head = length // 2
        return ids[:head] + ids[len(ids) - (length - head) :]
    raise ValueError(f"truncation {mode!r}: accepted left, right, middle (or error)")


def check_columns(path: str, rows: list[dict[str, Any]], keys: Mapping[str, str]) -> None:
    """Raise unless the file has rows and each `role -> column` in `keys` (dotted: into a
    struct column) is in its first row; the error lists the columns, nested ones dotted."""
    if not rows:
        raise ValueError(f"data file {path!r} has no rows")
    for role, key in keys.items():
        if not _has_column(rows[0], key):
            raise KeyError(
                f"{role} column {key!r} not found in {path!r} (set data.{role}_key to one "
                f"of its columns: {columns(rows[0])})"
            )


def default_answer_key(path: str, rows: list[dict[str, Any]]) -> str:
    """The first of `DEFAULT_ANSWER_KEYS` in the file's first row (data.answer_key unset)."""
    if not rows:
        raise ValueError(f"data file {path!r} has no rows")
    for key in DEFAULT_ANSWER_KEYS:
        if _has_column(rows[0], key):
            return key
    raise KeyError(
        f"no answer column in {path!r}: data.answer_key unset looks for "
        f"{' or '.join(repr(k) for k in DEFAULT_ANSWER_KEYS)}; set data.answer_key to one of "
        f"its columns: {columns(rows[0])}"
    )


def columns(row: Mapping[str, Any]) -> list[str]:
    """A row's columns, the fields of a struct column dotted (`reward_model.ground_truth`)."""
    out = []
    for key, value in row.items():
        if isinstance(value, Mapping) and value:
            out += [f"{key}.{sub}" for sub in columns(value)]
        else:
            out.append(str(key))
    return out


def _has_column(row: Mapping[str, Any], key: str) -> bool:
    value: Any = row
    for part in [key] if key in row else key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False
        value = value[part]
    return True


def read_rows(
    files: list[str] | str, *, split: str = "train", cache_dir: str | None = None
) -> list[dict[str, Any]]:
    """All rows of the files, in order, as plain dicts. Local files are read without
    `datasets` (jsonl and json with the standard library, parquet with pyarrow); a hub dataset
    id goes through `datasets.load_dataset` (`split`, `cache_dir`). Rows of one read share
    their columns: a row missing a column has it as None, as a table would."""
    paths = [files] if isinstance(files, str) else list(files)
    if not paths:
        raise ValueError("no data files given")
    if len(paths) == 1 and _is_hub_id(paths[0]):
        # Imported here: slow to import, large to install, and needed only for hub names.
        import datasets

        return datasets.load_dataset(paths[0], split=split, cache_dir=cache_dir).to_list()
    rows: list[dict[str, Any]] = []
    for path in paths:
        fmt = _local_format(path)
        table = read_parquet(path) if fmt == "parquet" else read_json(path)
        if not table:
            raise ValueError(f"no rows in {path}")
        rows.extend(table)
    return _same_columns(rows)


def read_json(path: str) -> list[dict[str, Any]]:
    """Rows of a .jsonl file (one JSON object a line), or of a .json file holding a list of
    objects or, like .jsonl, one object a line."""
    if path.endswith(".jsonl"):
        return _json_lines(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        value = json.loads(text)
    except ValueError:
        return _json_lines(path)  # JSON lines in a .json file
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list) or not all(isinstance(row, dict) for row in value):
        raise ValueError(
            f"{path}: a JSON {type(value).__name__}, not a list of objects (one object a row)"
        )
    return value


def read_parquet(path: str) -> list[dict[str, Any]]:
    """Rows of a parquet file, read with pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow "
            "(or give the data as .jsonl)"
        ) from None
    return list(pq.read_table(path).to_pylist())


def _json_lines(path: str) -> list[dict[str, Any]]:
    check_jsonl(path)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _same_columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row with every column any row has (in first-seen order), None where missing;
    struct columns likewise, field by field."""
    schema: dict[str, Any] = {}
    for row in rows:
        _merge_schema(schema, row)
    return [_conform(row, schema) for row in rows]


def _merge_schema(schema: dict[str, Any], row: Mapping[str, Any]) -> None:
    """Add `row`'s columns to `schema` (column -> None, or a struct column's own schema)."""
    for key, value in row.items():
        if isinstance(value, Mapping):
            sub = schema.get(key)
            if sub is None:
                sub = schema[key] = {}
            _merge_schema(sub, value)
        else:
            schema.setdefault(key, None)


def _conform(row: Mapping[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, sub in schema.items():
        value = row.get(key)
        out[key] = _conform(value, sub) if sub is not None and isinstance(value, Mapping) else value
    return out


def check_jsonl(path: str) -> None:
    """Raise ValueError naming `path` and the line when a line is not one JSON object, or when
    the file holds no row (`datasets` would say neither)."""
    rows = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{path} line {number}: not valid JSON ({err})") from None
            if not isinstance(value, dict):
                raise ValueError(
                    f"{path} line {number}: a {type(value).__name__}, not a JSON object (one row "
                    'per line: {"prompt": ..., "answer": ...})'
                )
            rows += 1
    if rows == 0:
        raise ValueError(f"no rows in {path}")


def render_prompt(
    prompt: Any,
    row: int,
    tokenizer: Any,
    use_template: bool,
    system_prompt: str | None,
) -> str:
    """The text the model sees for one prompt."""
    if isinstance(prompt, str):
        if not use_template:
            return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
        prompt = [{"role": "user", "content": prompt}]
    messages = _messages(prompt, row)
    if not use_template:
        raise ValueError(
            f"row {row}: the prompt is a chat message list, but "
            + (
                "apply_chat_template is off"
                if getattr(tokenizer, "chat_template", None)
                else "the tokenizer has no chat template"
            )
            + "; give plain-string prompts or a tokenizer with a chat_template"
        )
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return str(text)


def prompt_messages(prompt: Any, row: int, system_prompt: str | None) -> list[dict[str, str]]:
    """The prompt as chat messages: a string is one user turn; the system prompt goes first."""
    messages = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(prompt, row)
    )
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def _messages(prompt: Any, row: int) -> list[dict[str, str]]:
    ok = isinstance(prompt, list) and bool(prompt)
    ok = ok and all(isinstance(m, Mapping) and {"role", "content"} <= set(m) for m in prompt)
    if not ok:
        raise ValueError(
            f"row {row}: prompt must be a string or a non-empty list of "
            f"{{'role': ..., 'content': ...}} messages, got {prompt!r:.120}"
        )
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def _answer(row: Mapping[str, Any], key: str, index: int) -> str:
    value: Any = row
    for part in [key] if key in row else key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(f"row {index}: answer key {key!r} not found (missing {part!r})")
        value = value[part]
    if value is None or isinstance(value, (list, dict)):
        raise ValueError(f"row {index}: answer {key!r} is {value!r}; need a string or number")
    return str(value)


def _local_format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in LOCAL_FORMATS:
        raise ValueError(
            f"data file {path!r} has extension {ext!r}; accepted: {', '.join(LOCAL_FORMATS)}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    return LOCAL_FORMATS[ext]


def _is_hub_id(name: str) -> bool:
    """A name that is neither an existing path nor a file name with a data extension."""
    ext = os.path.splitext(name)[1].lower()
    return not os.path.exists(name) and ext not in LOCAL_FORMATS


class PromptLoader:
    """Batches of prompts, epoch after epoch. Epoch e's order is a permutation drawn from
    (seed, e), so the position (epoch, items consumed) is the whole state: a loader restored
    from `state_dict()` draws exactly the batches the uninterrupted one would have."""

    def __init__(
        self,
        dataset: Sequence[PromptItem],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty (were all prompts filtered as overlong?)")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"batch_size={batch_size} > {len(dataset)} prompts with drop_last: no batch "
                "could ever be drawn; lower the batch size or set drop_last=False"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    def next_batch(self, size: int | None = None) -> list[PromptItem]:
        """The next `size` prompts (default: the batch size), never across an epoch's end."""
        size = self.batch_size if size is None else size
        if size == 0:
            return []
        n = len(self.dataset)
        if self.position >= n or (self.drop_last and self.position + size > n):
            self.epoch, self.position = self.epoch + 1, 0
        order = self.order(self.epoch)
        picked = order[self.position : self.position + size]
        self.position += len(picked)
        return [self.dataset[i] for i in picked.tolist()]

    def order(self, epoch: int) -> np.ndarray:
        """The dataset positions of epoch `epoch`, in the order they are drawn."""
        if epoch != self._order_epoch:
            n = len(self.dataset)
            rng = np.random.default_rng([self.seed, epoch])
            self._order = rng.permutation(n) if self.shuffle else np.arange(n)
            self._order_epoch = epoch
        return self._order

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_items": len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume; the seed, shuffle flag and dataset size must match, or the saved position
        would point into a different order."""
        for key, mine in (
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("num_items", len(self.dataset)),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has {mine!r}: "
                    "the saved position belongs to a different order"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def dataset_for(
    config: JobConfig, tokenizer: Any, files: Any, validation: bool = False
) -> PromptDataset:
    """`files` read as the job's `data.*` settings say (`data.val_max_samples` for the
    `validation` set, `data.train_max_samples` for the training one)."""
    d = config.data
    return load_prompt_dataset(
        files,
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        tokenizer=tokenizer,
        max_prompt_length=d.max_prompt_length,
        filter_overlong_prompts=d.filter_overlong_prompts,
        truncation=d.truncation,
        apply_chat_template=d.apply_chat_template,
        system_prompt=d.system_prompt,
        max_samples=d.val_max_samples if validation else d.train_max_samples,
        sample_seed=d.seed if d.shuffle else None,
    )
