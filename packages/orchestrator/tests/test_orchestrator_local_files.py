"""Local data files read without `datasets`: jsonl, json (a list of objects or JSON lines),
parquet through pyarrow, with a clear error naming the file where pyarrow is missing; rows of
one read share their columns (None where a row has none), struct fields included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from patrl.orchestrator.data import read_rows


def test_json_files_in_either_layout_and_missing_columns_as_none(tmp_path: Path) -> None:
    lines = tmp_path / "a.jsonl"
    lines.write_text('{"prompt": "p0", "meta": {"n": 1}}\n\n{"prompt": "p1", "answer": "2"}\n')
    listed = tmp_path / "b.json"
    listed.write_text(json.dumps([{"prompt": "p2", "meta": {"gold": "g"}}]))
    json_lines = tmp_path / "c.json"
    json_lines.write_text('{"prompt": "p3"}\n{"prompt": "p4"}\n')
    rows = read_rows([str(lines), str(listed), str(json_lines)])
    assert rows == [
        {"prompt": "p0", "meta": {"n": 1, "gold": None}, "answer": None},
        {"prompt": "p1", "meta": None, "answer": "2"},
        {"prompt": "p2", "meta": {"n": None, "gold": "g"}, "answer": None},
        {"prompt": "p3", "meta": None, "answer": None},
        {"prompt": "p4", "meta": None, "answer": None},
    ]


def test_a_json_file_that_is_not_a_list_of_objects_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad.json: a JSON list, not a list of objects"):
        read_rows(str(bad))


def test_parquet_without_pyarrow_names_the_file_and_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import then raises
    with pytest.raises(ImportError, match=r"rows.parquet needs pyarrow.*pip install pyarrow"):
        read_rows(str(path))


def test_parquet_rows_through_pyarrow(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    rows = [{"prompt": "p", "reward_model": {"ground_truth": "3", "style": "rule"}}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert read_rows(str(path)) == rows
