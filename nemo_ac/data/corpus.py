"""A ``data.kind: text`` corpus, tokenized once per dataset and tokenizer, then memory-mapped by every rank.

``prepare_corpus(data)`` computes the corpus key (``config.corpus_key``: the dataset's files or Hub revision, the
column, the tokenizer's files, the chat template, the code version) and maps the cache entry it names
(``data.token_cache``). When there is none, one process builds it while the others wait on its lock: the rows are
read through ``datasets`` (Arrow, memory-mapped: a corpus larger than RAM never is in memory), ``SHARD_ROWS`` at a
time, each shard tokenized in one batched call of the tokenizer and appended to the entry. A relaunch, a restart
after a failure and every other rank map the finished entry: no tokenizer is loaded, no row is read.

While tokenizing, the builder shows a progress bar on a terminal (rows/s, ETA) or a line every ``LOG_EVERY_S``
seconds in a log; at the end one line says how many documents and tokens went where, and how large the entry is.

Bad rows are counted skips, one warning per reason (``config.text_rows``), repeated from the entry's ``meta.json``
when a later launch maps it; a dataset without any usable row, a missing column, or a tokenizer larger than
``model.vocab_size`` is a ``ConfigError`` naming the key and the fix.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nemo_ac.config.corpus_key import cache_root, corpus_key, entry_name
from nemo_ac.config.data_files import diagnose_file
from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.schema import DataConfig
from nemo_ac.config.text_rows import SkippedRows, row_problem
from nemo_ac.data.text_tokenizers import TextTokenizer, TokenizedDocument, build_text_tokenizer
from nemo_ac.data.token_cache import CacheProblem, EntryWriter, LockHolder, MappedCorpus, build_once, discard
from nemo_ac.data.token_cache import open_entry as _open_entry

SHARD_ROWS = 512
LOG_EVERY_S = 30.0

Say = Callable[[str], None]


def _fail(key: str, message: str) -> ConfigError:
    return ConfigError(ConfigIssue(key, message))


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_rows(data: DataConfig) -> Any:
    """The dataset's rows: a local file, a directory or ``save_to_disk`` directory, or a Hub id (read by this process
    alone: the builder; every other rank waits for the entry instead of reading)."""
    from nemo_ac.data.medpix import load_medpix_dataset

    if data.path is None:
        raise _fail(
            "data.path", "data.kind text needs data.path (a JSONL / parquet file, a save_to_disk dir or a Hub id)"
        )
    local = Path(data.path).expanduser()
    if local.is_file() and local.stat().st_size == 0:
        raise _fail("data.path", f"{data.path!r} is an empty file; point data.path at a file with one document per row")
    try:
        if not local.exists():
            import datasets

            return datasets.load_dataset(data.path, split=data.split)
        return load_medpix_dataset(str(local), data.split)[0]
    except Exception as exc:
        if not local.exists():
            raise
        problem = diagnose_file(local)  # "DatasetGenerationError: An error occurred" names no line; this does
        if problem is None:
            problem = f"{data.path!r} cannot be read by the datasets library: {type(exc).__name__}: {exc}"
        raise _fail("data.path", problem) from exc


def _column_of(data: DataConfig) -> tuple[str, str]:
    if data.messages_column:
        return "data.messages_column", data.messages_column
    return "data.text_column", data.text_column


def _shards(rows: Any, column: str) -> Iterator[list[Any]]:
    """``column``'s values, ``SHARD_ROWS`` rows at a time (only that column is read)."""
    if hasattr(rows, "select_columns"):
        rows = rows.select_columns([column])
    for start in range(0, len(rows), SHARD_ROWS):
        batch = rows[start : start + SHARD_ROWS]
        yield list(batch[column]) if isinstance(batch, Mapping) else [row[column] for row in batch]


class _Progress:
    """A bar on a terminal (tqdm: rows/s, ETA), else a line every ``LOG_EVERY_S`` seconds."""

    def __init__(self, total: int, label: str, say: Say) -> None:
        self.total, self.label, self.say = total, label, say
        self.done, self.start, self.last = 0, time.monotonic(), time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="rows", desc=f"data | tokenizing {label}", file=sys.stderr)

    def update(self, rows: int) -> None:
        self.done += rows
        if self.bar is not None:
            self.bar.update(rows)
            return
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / max(rate, 1e-9)
            self.say(
                f"data | tokenizing {self.label}: {self.done:,} / {self.total:,} rows ({rate:,.0f} rows/s, "
                f"ETA {eta / 60:.1f} min)"
            )

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return time.monotonic() - self.start


def _check_vocab(tokenizer_vocab: int, vocab_size: int | None) -> None:
    if vocab_size is not None and tokenizer_vocab > vocab_size:
        raise _fail(
            "model.vocab_size",
            f"{vocab_size} is smaller than data.tokenizer's {tokenizer_vocab} tokens; set model.vocab_size >= "
            f"{tokenizer_vocab} or use the model's own tokenizer",
        )


def tokenize_into(
    writer: EntryWriter, rows: Any, data: DataConfig, tokenizer: TextTokenizer, progress: _Progress
) -> SkippedRows:
    """Every usable row of ``rows`` tokenized into ``writer``, in order; the others counted per reason."""
    key, column = _column_of(data)
    names = list(getattr(rows, "column_names", None) or (rows[0].keys() if len(rows) else []))
    if not len(rows):
        raise _fail("data.path", f"{data.path!r} holds no rows (split {data.split!r}); point data.path at a dataset")
    if column not in names:
        raise _fail(key, f"column {column!r} is not in {data.path!r} (columns: {names}); set {key} to one of them")
    chat = bool(data.messages_column)
    skipped, index = SkippedRows(), 0
    for values in _shards(rows, column):
        usable, numbers = [], []
        for value in values:
            problem = row_problem(value, chat=chat)
            if problem is None:
                usable.append(value)
                numbers.append(index)
            else:
                skipped.add(index, *problem)
            index += 1
        for number, encoded in zip(numbers, tokenizer.encode(usable, chat=chat) if usable else []):
            if isinstance(encoded, TokenizedDocument):
                writer.add(encoded.tokens, encoded.targets)
            else:
                skipped.add(number, *encoded)
        progress.update(len(values))
    return skipped


def _skip_warnings(data: DataConfig, lines: Sequence[str]) -> None:
    key, column = _column_of(data)
    for line in lines:
        warnings.warn(f"data.kind text: skipped rows of {data.path!r} ({key} {column!r}): {line}", stacklevel=3)


def _build(final: Path, key: dict[str, Any], data: DataConfig, vocab_size: int | None, say: Say) -> None:
    """Tokenizes the corpus into the entry ``final`` (this process holds its lock)."""
    started = time.monotonic()
    if final.exists():
        discard(final)  # truncated or stale: reported by prepare_corpus
    for partial in final.parent.glob(f"{final.name}.partial-*"):
        discard(partial)  # a dead builder's: only the lock's holder writes one, and we hold it
    rows = load_rows(data)
    tokenizer = build_text_tokenizer(data.tokenizer, chat=bool(data.messages_column), chat_template=data.chat_template)
    _check_vocab(tokenizer.vocab_size, vocab_size)  # before any work
    writer = EntryWriter(final)
    progress = _Progress(len(rows), str(data.path), say)
    try:
        try:
            skipped = tokenize_into(writer, rows, data, tokenizer, progress)
        except UnicodeDecodeError as exc:  # Arrow keeps a non-UTF-8 JSONL string as it is, until the row is read
            problem = diagnose_file(data.path) if data.path else None
            raise _fail("data.path", problem or f"{data.path!r}: {exc}") from exc
        progress.close()
        seconds = time.monotonic() - started
        if writer.num_documents == 0:
            key_name, _ = _column_of(data)
            raise _fail(
                key_name,
                f"no usable rows in {data.path!r} ({'; '.join(skipped.lines())}); check {key_name} and the file",
            )
        path = writer.finish(
            {
                "key": key,
                "vocab_size": tokenizer.vocab_size,
                "rows": len(rows),
                "skipped": list(skipped.lines()),
                "source": str(data.path),
                "tokenizer": data.tokenizer or "tiny",
                "built_by": f"{socket.gethostname()} pid {os.getpid()}",
                "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "seconds": round(seconds, 3),
            }
        )
    except BaseException:
        progress.close()
        writer.abort()
        raise
    built = _open_entry(path, key)
    assert built is not None
    say(
        f"data | tokenized {len(rows):,} rows of {data.path} into {built.num_documents:,} documents, "
        f"{built.total_tokens:,} tokens, in {seconds:.1f} s ({len(rows) / max(seconds, 1e-9):,.0f} rows/s): {path} "
        f"({built.nbytes / 2**20:,.1f} MiB)"
    )


def _writable_root(root: Path, data: DataConfig) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{socket.gethostname()}-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise _fail(
            "data.cache_dir",
            f"'{root}' cannot be written ({exc.strerror or exc}) and the tokenized corpus of {data.path!r} is not "
            "there yet: point data.cache_dir (or $NEMO_AC_DATA_CACHE) at a writable directory, or tokenize it once "
            "where it can be written (nemo-ac tokenize RECIPE) and copy the entry here",
        ) from exc


def _usable(final: Path, key: dict[str, Any]) -> bool:
    try:
        return _open_entry(final, key) is not None
    except CacheProblem:
        return False


def prepare_corpus(
    data: DataConfig, *, vocab_size: int | None = None, announce: bool = True, say: Say = _say
) -> MappedCorpus:
    """``data``'s tokenized corpus, mapped: from the cache, or built by this process or another one first (module
    docstring). ``announce``: say which entry was mapped (rank 0 of a run)."""
    key = corpus_key(data)
    root = cache_root(data)
    final = root / entry_name(data, key)
    try:
        mapped = _open_entry(final, key)
    except CacheProblem as problem:
        warnings.warn(f"data.cache_dir: {problem}; tokenizing it again", stacklevel=2)
        mapped = None
    if mapped is None:
        _writable_root(root, data)

        def waiting(holder: LockHolder) -> None:
            say(f"data | waiting for {holder.describe()} to tokenize {data.path} into {final}")

        built = build_once(
            final,
            is_complete=lambda: _usable(final, key),
            build=lambda: _build(final, key, data, vocab_size, say),
            waiting=waiting,
        )
        mapped = _open_entry(final, key)
        if mapped is None:
            raise RuntimeError(f"the tokenized corpus {final} vanished after it was built")
        announce = announce and not built
    _check_vocab(int(mapped.meta["vocab_size"]), vocab_size)
    _skip_warnings(data, mapped.meta.get("skipped", []))
    if announce:
        meta = mapped.meta
        say(
            f"data | mapped {mapped.path}: {mapped.num_documents:,} documents, {mapped.total_tokens:,} tokens "
            f"({mapped.nbytes / 2**20:,.1f} MiB), tokenized {meta.get('built_at', '?')} by {meta.get('built_by', '?')}"
        )
    return mapped
