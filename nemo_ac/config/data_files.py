"""The local data files a recipe reads, checked before any process group: existence, encoding, parse, columns,
the first rows against the row rule (``config.text_rows``). Pure Python (pyarrow only for parquet and
``save_to_disk`` directories, when installed); no torch, no network.

Without this, every data error came after the process group, the model build and the weight load (on a flagship,
minutes), and named neither file nor line: ``UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9 in
position 3`` for a Latin-1 file, ``DatasetGenerationError: An error occurred while generating the dataset`` for a
malformed JSONL line, ``ConnectionError: Couldn't reach 'data/tiny_corpsu.jsonl' on the Hub`` for a typo.

What is read: ``data.path`` itself (a file, a ``save_to_disk`` directory, or a directory of data files, at most
``MAX_FILES`` of them) and of each file its head, up to ``HEAD_ROWS`` rows or ``HEAD_BYTES`` bytes: UTF-8 of every
text line, JSON of every JSONL line (both named by line number and byte offset), the column ``data.*_column``
names, and for ``kind: text`` each row against the row rule: rows the loader would skip are a note naming them; a
head with no usable row at all is an error (the column holds something else). A Hub dataset id is not checked
(that would need the network); ``looks_local`` decides which names are paths. The loader calls
``diagnose_file`` on the whole file when the ``datasets`` library fails on it, so an error past the head is named
by its line too.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_ac.config.errors import ConfigIssue, closest
from nemo_ac.config.pretrained import looks_like_hub_id
from nemo_ac.config.schema import DataConfig, RecipeConfig
from nemo_ac.config.text_rows import SkippedRows, row_problem

# File suffix -> the ``datasets`` builder that reads it (``data.medpix.load_medpix_dataset``).
TABULAR = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
HEAD_ROWS = 1000
HEAD_BYTES = 8 * 2**20
MAX_FILES = 8
_TEXT_FORMATS = (".jsonl", ".json", ".csv")


class DataFileError(ValueError):
    """A local data file that cannot be read; the message names the file, the line or byte, and the fix."""


@dataclass
class Head:
    """The first rows of one data file: (row number, where in the file when that says more, e.g. "line 4", row
    mapping), and the columns seen."""

    rows: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    columns: set[str] = field(default_factory=set)


def _lines(path: Path, *, max_bytes: int | None) -> Iterator[tuple[int, int, str]]:
    """(line number from 1, byte offset of the line, decoded text) of ``path``, up to ``max_bytes`` (a line cut
    there is not yielded: a long single-line file is never read whole); ``DataFileError`` at the first line that is
    not UTF-8, naming the byte."""
    offset = 0
    with path.open("rb") as handle:
        for number in itertools.count(1):
            limit = -1 if max_bytes is None else max_bytes - offset
            if limit == 0:
                return
            raw = handle.readline(limit)
            if not raw:
                return
            cut = limit > 0 and len(raw) == limit and not raw.endswith(b"\n")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if cut and exc.reason == "unexpected end of data":
                    return  # the limit split a character
                raise DataFileError(
                    f"{path}: line {number} is not UTF-8: byte 0x{raw[exc.start]:02x} at byte offset "
                    f"{offset + exc.start} (column {exc.start + 1}); save the file as UTF-8 (from Latin-1: iconv -f "
                    f"latin1 -t utf-8 {path.name} > fixed_{path.name})"
                ) from exc
            if cut:
                return
            yield number, offset, text.removeprefix("\ufeff") if number == 1 else text
            offset += len(raw)


def _jsonl_head(path: Path, *, max_rows: int | None, max_bytes: int | None) -> Head:
    head = Head()
    for number, _, text in _lines(path, max_bytes=max_bytes):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataFileError(
                f"{path}: line {number} is not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno}): "
                f"{text.strip()[:80]!r}; fix or remove that line (JSONL: one JSON object per line)"
            ) from exc
        if not isinstance(row, dict):
            raise DataFileError(
                f"{path}: line {number} is a JSON {type(row).__name__}, not an object; JSONL holds one "
                '{"column": value, ...} object per line'
            )
        head.rows.append((len(head.rows), f"line {number}", row))
        head.columns.update(row)
        if max_rows is not None and len(head.rows) >= max_rows:
            break
    return head


def _json_head(path: Path) -> Head:
    """A ``.json`` file: JSON Lines, or (when it fits ``HEAD_BYTES``) one array of objects / object of columns."""
    first = ""
    for _, _, text in _lines(path, max_bytes=HEAD_BYTES):  # the encoding of the whole head first
        first = first or text.lstrip()
    if not first.startswith("["):
        try:
            return _jsonl_head(path, max_rows=HEAD_ROWS, max_bytes=HEAD_BYTES)
        except DataFileError:
            if path.stat().st_size > HEAD_BYTES:
                raise
    if path.stat().st_size > HEAD_BYTES:
        return Head()  # a large single JSON document: its encoding was checked, the datasets library parses it
    try:
        whole = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise DataFileError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); a .json file holds JSON "
            "Lines, an array of objects or an object of columns"
        ) from exc
    if isinstance(whole, dict) and all(isinstance(v, list) for v in whole.values()):
        count = min(len(v) for v in whole.values()) if whole else 0
        whole = [{k: v[i] for k, v in whole.items()} for i in range(count)]
    head = Head()
    for i, row in enumerate(whole[:HEAD_ROWS] if isinstance(whole, list) else []):
        if isinstance(row, dict):
            head.rows.append((i, "", row))
            head.columns.update(row)
    return head


def _csv_head(path: Path) -> Head:
    text = "".join(line for _, _, line in _lines(path, max_bytes=HEAD_BYTES))
    reader = csv.DictReader(io.StringIO(text))
    head = Head(columns=set(reader.fieldnames or []))
    for i, row in enumerate(reader):
        if i >= HEAD_ROWS:
            break
        head.rows.append((i, f"line {reader.line_num}", dict(row)))
    return head


def _arrow_head(columns: list[str], batches: Iterator[Any]) -> Head:
    head = Head(columns=set(columns))
    for batch in batches:
        for row in batch.to_pylist():
            head.rows.append((len(head.rows), "", row))
            if len(head.rows) >= HEAD_ROWS:
                return head
    return head


def _parquet_head(path: Path) -> Head | None:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # the hf extra is missing: check_environment names it
        return None
    try:
        table = pq.ParquetFile(str(path))
        return _arrow_head(table.schema_arrow.names, table.iter_batches(batch_size=HEAD_ROWS))
    except Exception as exc:  # pyarrow raises its own types for every kind of damage
        raise DataFileError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from exc


def file_head(path: Path) -> Head | None:
    """The head of one data file (None: a format this module does not read ahead); ``DataFileError`` naming the
    file and the line or byte that cannot be read."""
    if path.stat().st_size == 0:
        raise DataFileError(f"{path} is an empty file; point data.path at a file with one document per row")
    if path.suffix == ".jsonl":
        return _jsonl_head(path, max_rows=HEAD_ROWS, max_bytes=HEAD_BYTES)
    if path.suffix == ".json":
        return _json_head(path)
    if path.suffix == ".csv":
        return _csv_head(path)
    if path.suffix == ".parquet":
        return _parquet_head(path)
    return None


def diagnose_file(path: str | Path) -> str | None:
    """The first line of a whole local text-format file that is not UTF-8 (or, in JSONL, not one JSON object), or
    None. For the loader, after the ``datasets`` library failed on the file (the preflight reads only the head)."""
    local = Path(path)
    if not local.is_file() or local.suffix not in _TEXT_FORMATS:
        return None
    try:
        if local.suffix == ".jsonl":
            _jsonl_head(local, max_rows=None, max_bytes=None)
        else:
            for _ in _lines(local, max_bytes=None):
                pass
    except DataFileError as exc:
        return str(exc)
    return None


def _save_to_disk_head(root: Path, split: str) -> tuple[Head | None, ConfigIssue | None]:
    """Columns (from dataset_info.json) and first rows (pyarrow) of a ``save_to_disk`` directory."""
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            return None, ConfigIssue(
                "data.split", f"{split!r} is not a split of {root} (splits: {splits}); set data.split to one of them"
            )
        root = root / split
    info = root / "dataset_info.json"
    features = json.loads(info.read_text()).get("features", {}) if info.is_file() else {}
    head = Head(columns=set(features))
    try:
        import pyarrow as pa

        files = json.loads((root / "state.json").read_text()).get("_data_files", [])
        if files:
            with pa.memory_map(str(root / files[0]["filename"])) as source:
                return _arrow_head(sorted(features), iter(pa.ipc.open_stream(source))), None
    except Exception:  # rows are a bonus here; the loader reports an unreadable directory itself
        pass
    return head, None


def looks_local(path: str) -> bool:
    """Whether a ``data.path`` that does not exist was meant as a local path rather than a Hub dataset id: it has
    a data file suffix, is not in the Hub's ``org/name`` alphabet, or its parent directory exists here."""
    local = Path(path).expanduser()
    return local.suffix in TABULAR or not looks_like_hub_id(path) or (len(local.parts) > 1 and local.parent.is_dir())


def _missing(path: str) -> ConfigIssue:
    local = Path(path).expanduser()
    where = "" if local.is_absolute() else f" (relative to the working directory {Path.cwd()})"
    if local.parent.is_dir():
        # A file name shares its suffix with its neighbours: only a close match is a likely typo.
        guess = closest(local.name, [p.name for p in local.parent.iterdir()], cutoff=0.8)
        hint = f" Did you mean '{local.parent / guess}'?" if guess else ""
    else:
        hint = f" Its directory {local.parent} does not exist either."
    return ConfigIssue(
        "data.path",
        f"{path!r} does not exist{where}.{hint} Point data.path at an existing file or directory (or a Hub dataset "
        "id, org/name)",
    )


def _columns(data: DataConfig, head: Head) -> dict[str, str]:
    """data.* key -> the column it names, that the loader needs."""
    if data.kind == "text":
        if data.messages_column:
            return {"data.messages_column": data.messages_column}
        return {"data.text_column": data.text_column}
    image = data.image_column
    if image == "auto":
        image = "image" if "image" in head.columns else "image_id"
    return {
        "data.image_column": image,
        "data.question_column": data.question_column,
        "data.answer_column": data.answer_column,
    }


def _head_issues(data: DataConfig, file: Path, head: Head, notes: list[str]) -> list[ConfigIssue]:
    if not head.columns and not head.rows:
        return [ConfigIssue("data.path", f"{file} holds no rows; point data.path at a dataset")]
    issues = [
        ConfigIssue(
            key, f"column {column!r} is not in {file} (columns: {sorted(head.columns)}); set {key} to one of them"
        )
        for key, column in _columns(data, head).items()
        if head.columns and column not in head.columns
    ]
    if issues or data.kind != "text" or not head.rows:
        return issues
    key, column = next(iter(_columns(data, head).items()))
    skipped = SkippedRows()
    for row, where, values in head.rows:
        problem = row_problem(values.get(column), chat=bool(data.messages_column))
        if problem is not None:
            skipped.add(row, problem[0], f"{where}: {problem[1]}" if where else problem[1])
    if not skipped.total:
        return []
    listed = "; ".join(skipped.lines())
    if skipped.total == len(head.rows):
        shape = (
            "a list of {role, content} turns with an assistant turn" if data.messages_column else "a non-empty string"
        )
        return [
            ConfigIssue(
                key,
                f"none of the first {len(head.rows)} rows of {file} is usable: {listed}. Every row's {column!r} must be "
                f"{shape}; check {key} and the file",
            )
        ]
    notes.append(
        f"data.path: {skipped.total} of the first {len(head.rows)} rows of {file} will be skipped (counted, "
        f"{key} {column!r}): {listed}"
    )
    return []


def _data_files(root: Path) -> list[Path]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TABULAR)
    return files[:MAX_FILES]


def check_data_files(recipe: RecipeConfig, notes: list[str]) -> list[ConfigIssue]:
    """Before any process group: ``data.path`` of ``kind: text`` / ``medpix`` exists, and what its files' heads
    hold fits the recipe (module docstring). Rows the loader will skip go to ``notes``."""
    data = recipe.data
    if data.source is not None or data.kind not in ("text", "medpix") or not data.path:
        return []
    if data.kind == "medpix" and (data.path == "synthetic" or data.path.startswith("synthetic:")):
        return []
    local = Path(data.path).expanduser()
    if not local.exists():
        return [_missing(data.path)] if looks_local(data.path) else []  # a Hub id: read at the run's start
    if local.is_file():
        if local.suffix not in TABULAR:
            return [
                ConfigIssue(
                    "data.path",
                    f"{data.path!r}: unsupported file type {local.suffix!r}; use {', '.join(sorted(TABULAR))}, a "
                    "save_to_disk directory or a Hub dataset id",
                )
            ]
        files = [local]
    elif (local / "state.json").exists() or (local / "dataset_dict.json").exists():
        head, issue = _save_to_disk_head(local, data.split)
        if issue is not None:
            return [issue]
        return _head_issues(data, local, head, notes) if head is not None else []
    else:
        files = _data_files(local)
        if not files:
            return [
                ConfigIssue(
                    "data.path",
                    f"{data.path!r} is a directory without data files ({', '.join(sorted(TABULAR))}) and is no "
                    "save_to_disk directory; point data.path at the data",
                )
            ]
    issues: list[ConfigIssue] = []
    for file in files:
        try:
            head = file_head(file)
        except (DataFileError, OSError) as exc:
            issues.append(ConfigIssue("data.path", str(exc)))
            continue
        if head is not None:
            issues += _head_issues(data, file, head, notes)
    return issues
