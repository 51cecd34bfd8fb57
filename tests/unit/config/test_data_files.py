"""The preflight's read of local data files (``nemo_ac.config.data_files``) for every source format the loader
reads: JSONL, JSON, CSV, parquet, ``save_to_disk`` directories and directories of files; which missing names are
paths (an error naming the file) and which are Hub ids (not read: no network)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nemo_ac.config.data_files import check_data_files, looks_local
from nemo_ac.config.schema import DataConfig, RecipeConfig


def check(path: str | Path, **data: object) -> tuple[list[str], list[str]]:
    """(["key: message", ...], notes) of the data check for a text recipe reading ``path``."""
    recipe = RecipeConfig()
    recipe = dataclasses.replace(recipe, data=DataConfig(**{"kind": "text", "path": str(path), **data}))
    notes: list[str] = []
    return [str(issue) for issue in check_data_files(recipe, notes)], notes


def test_tabular_files_and_directories(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"body": f"document {i}"} for i in range(10)] + [{"body": ""}]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "part.parquet"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "rows.csv").write_text("body\n" + "".join(f"doc {i}\n" for i in range(5)))
    (tmp_path / "array.json").write_text(json.dumps(rows))
    for name in ("part.parquet", "saved", "rows.csv", "array.json"):
        issues = check(tmp_path / name)[0]
        assert issues and issues[0].startswith("data.text_column: column 'text' is not in"), name
        assert "set data.text_column to one of them" in issues[0] and "'body'" in issues[0], name
        assert check(tmp_path / name, text_column="body")[0] == [], name
    # the empty text of row 10 is a note: the loader skips and counts it
    assert check(tmp_path / "part.parquet", text_column="body")[1] == [
        f"data.path: 1 of the first 11 rows of {tmp_path / 'part.parquet'} will be skipped (counted, data.text_column "
        "'body'): empty text: 1 row (row 10: empty)"
    ]
    assert check(tmp_path / "saved", text_column="body", split="test")[0] == [
        f"data.split: 'test' is not a split of {tmp_path / 'saved'} (splits: ['train']); set data.split to one of them"
    ]


def test_directories_unsupported_and_empty_files(tmp_path):
    (tmp_path / "docs").mkdir()
    assert check(tmp_path / "docs")[0][0].startswith(f"data.path: '{tmp_path / 'docs'}' is a directory without data")
    (tmp_path / "docs" / "a.jsonl").write_text('{"text": "fine"}\n')
    (tmp_path / "docs" / "b.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    assert check(tmp_path / "docs")[0] == [
        f"data.path: {tmp_path / 'docs' / 'b.jsonl'}: line 2 is a JSON list, not an object; JSONL holds one "
        '{"column": value, ...} object per line'
    ]
    (tmp_path / "notes.txt").write_text("hello")
    assert "unsupported file type '.txt'" in check(tmp_path / "notes.txt")[0][0]
    (tmp_path / "empty.jsonl").write_text("")
    assert check(tmp_path / "empty.jsonl")[0] == [
        f"data.path: {tmp_path / 'empty.jsonl'} is an empty file; point data.path at a file with one document per row"
    ]


def test_medpix_columns_and_what_counts_as_a_path(tmp_path, monkeypatch):
    path = tmp_path / "vqa.jsonl"
    path.write_text(json.dumps({"image": "a.png", "question": "what?", "reply": "this"}) + "\n")
    assert check(path, kind="medpix")[0] == [
        f"data.answer_column: column 'answer' is not in {path} (columns: ['image', 'question', 'reply']); set "
        "data.answer_column to one of them"
    ]
    assert check("synthetic:8", kind="medpix")[0] == []
    monkeypatch.chdir(tmp_path)
    assert looks_local("corpus.jsonl") and looks_local("./corpus") and looks_local("/data/corpus")
    assert not looks_local("HuggingFaceH4/ultrachat_200k") and not looks_local("mmoukouba/MedPix-VQA")
    (tmp_path / "data").mkdir()
    assert looks_local("data/corpus")  # its directory is here: a path, not the Hub user "data"
    assert check("missing/corpus.jsonl")[0] == [
        f"data.path: 'missing/corpus.jsonl' does not exist (relative to the working directory {tmp_path}). Its "
        "directory missing does not exist either. Point data.path at an existing file or directory (or a Hub "
        "dataset id, org/name)"
    ]
