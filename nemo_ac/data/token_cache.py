"""A tokenized corpus on disk: flat memory-mapped arrays that every rank and every restart maps, written once.

Why not ``datasets.map`` and its Arrow cache: its cache key is a fingerprint of the mapped function, which
``datasets`` computes by pickling it with dill; a transformers tokenizer does not always pickle the same way twice
("Parameter 'function'=... couldn't be hashed properly, a random hash was used instead"), and then every launch
tokenizes again. Its rows also come back as Python lists per document, where packing wants one contiguous token
stream. This is Megatron's ``.bin`` / ``.idx`` layout instead, keyed by what nemo_ac itself says changes the tokens
(``data.corpus.corpus_key``), read with ``torch.from_file`` (an mmap: pages are shared by every rank of a node
through the page cache and only the pages a row touches are read).

One entry is a directory ``<cache_dir>/<name>/``:

- ``tokens.bin``: token ids, uint32 little-endian, every document's tokens one after the other;
- ``targets.bin``: one bit per token (least significant bit first), set where the token is a loss target;
- ``offsets.bin``: int64, ``num_documents + 1`` document starts into the token stream;
- ``meta.json``: the key, the counts, every file's byte size, the tokenizer's vocabulary size, the rows skipped per
  reason, and who built it when. Written last.

Nothing half-written is ever mapped: a builder writes into ``<name>.partial-<host>-<pid>/``, fsyncs, and renames it
into place in one step. An entry whose ``meta.json`` is missing or names another key, or whose files are not the
sizes it records (a copy that stopped early, a full disk), is reported and rebuilt, never used.

One builder at a time per entry, across the ranks of a node and across nodes sharing the directory: the builder
holds ``<name>.lock`` (created with ``O_EXCL``) and touches it every few seconds; the others wait for the entry to
appear. A lock whose holder died (its pid is gone on this host, or it has not been touched for ``STALE_LOCK_S``) is
taken over. No process group is involved: a tokenization longer than the process-group timeout cannot time out.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
FILES = ("tokens.bin", "targets.bin", "offsets.bin")
HEARTBEAT_S = 5.0
STALE_LOCK_S = 60.0
_BIT_WEIGHTS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


class CacheProblem(Exception):
    """An entry that exists but must not be used (truncated, stale, unreadable); the message says which and why."""


@dataclass(frozen=True)
class MappedCorpus:
    """A complete entry, mapped: token ids, packed target bits and document offsets, plus its ``meta.json``."""

    path: Path
    tokens: torch.Tensor  # uint32 [total_tokens], a view of the mapped file
    target_bits: torch.Tensor  # uint8 [ceil(total_tokens / 8)]
    offsets: torch.Tensor  # int64 [num_documents + 1]
    meta: dict[str, Any]

    @property
    def num_documents(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def total_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def nbytes(self) -> int:
        return sum(int(size) for size in self.meta["bytes"].values())

    def document_lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def token_ids(self, begin: int, end: int) -> torch.Tensor:
        """Token ids ``[begin, end)`` of the stream as int64 (copied out of the map)."""
        return self.tokens[begin:end].to(torch.int64)

    def targets(self, begin: int, end: int) -> torch.Tensor:
        """Target flags ``[begin, end)`` of the stream as bool."""
        first, last = begin >> 3, (end + 7) >> 3
        bits = (self.target_bits[first:last].unsqueeze(-1) & _BIT_WEIGHTS).ne(0).flatten()
        return bits[begin - (first << 3) : end - (first << 3)]

    def document(self, index: int) -> tuple[list[int], list[bool]]:
        """One document's (token ids, target flags): for tests and inspection."""
        begin, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.token_ids(begin, end).tolist(), self.targets(begin, end).tolist()


def _map(path: Path, name: str, dtype: torch.dtype, count: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_file(str(path / name), shared=False, size=count, dtype=dtype)


def open_entry(path: Path, key: dict[str, Any]) -> MappedCorpus | None:
    """The entry at ``path`` mapped, None when there is none; ``CacheProblem`` when one is there but unusable."""
    meta_file = path / "meta.json"
    if not path.is_dir():
        return None
    if not meta_file.is_file():
        raise CacheProblem(f"{path} has no meta.json (an entry written by hand or an older format)")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        raise CacheProblem(f"{meta_file} cannot be read ({exc})") from exc
    if meta.get("format") != FORMAT_VERSION or meta.get("key") != key:
        raise CacheProblem(f"{path} was built for another corpus, tokenizer or format (its meta.json key differs)")
    for name in FILES:
        expected, file = int(meta["bytes"][name]), path / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != expected:
            have = "is missing" if actual is None else f"has {actual:,} bytes"
            raise CacheProblem(f"{path} is truncated: {name} {have}, its meta.json says {expected:,}")
    total, documents = int(meta["total_tokens"]), int(meta["num_documents"])
    return MappedCorpus(
        path=path,
        tokens=_map(path, "tokens.bin", torch.uint32, total),
        target_bits=_map(path, "targets.bin", torch.uint8, (total + 7) // 8),
        offsets=_map(path, "offsets.bin", torch.int64, documents + 1),
        meta=meta,
    )


class EntryWriter:
    """Appends documents to a new entry in a private directory; ``finish`` makes it visible in one rename."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.partial = final.with_name(f"{final.name}.partial-{socket.gethostname()}-{os.getpid()}")
        if self.partial.exists():
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True)
        self._tokens = (self.partial / "tokens.bin").open("wb")
        self._targets = (self.partial / "targets.bin").open("wb")
        self._offsets = array("q", [0])
        self._pending_bits = bytearray()  # 0 / 1 per token not yet packed into a whole byte
        self.total_tokens = 0

    def add(self, tokens: list[int], targets: bytes | bytearray | list[bool]) -> None:
        if len(tokens) != len(targets):
            raise ValueError(f"a document has {len(tokens)} tokens but {len(targets)} target flags")
        self._tokens.write(array("I", tokens).tobytes())
        self._pending_bits += bytes(targets) if not isinstance(targets, bytes | bytearray) else targets
        self.total_tokens += len(tokens)
        self._offsets.append(self.total_tokens)
        if len(self._pending_bits) >= 1 << 20:
            self._pack(final=False)

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    def _pack(self, *, final: bool) -> None:
        whole = len(self._pending_bits) if final else len(self._pending_bits) & ~7
        if whole == 0:
            return
        flags = torch.frombuffer(bytearray(self._pending_bits[:whole]), dtype=torch.uint8)
        flags = torch.nn.functional.pad(flags, (0, -whole % 8)).view(-1, 8)
        packed = (flags.ne(0).to(torch.uint8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)
        self._targets.write(bytes(packed.tolist()))
        del self._pending_bits[:whole]

    def finish(self, meta: dict[str, Any]) -> Path:
        """Flushes, fsyncs and renames the entry into place; returns its path (another builder's, should one have
        finished first: both hold the same bytes)."""
        self._pack(final=True)
        (self.partial / "offsets.bin").write_bytes(self._offsets.tobytes())
        for handle in (self._tokens, self._targets):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        meta = {
            **meta,
            "format": FORMAT_VERSION,
            "total_tokens": self.total_tokens,
            "num_documents": self.num_documents,
            "bytes": {name: (self.partial / name).stat().st_size for name in FILES},
        }
        meta_file = self.partial / "meta.json"
        meta_file.write_text(json.dumps(meta, indent=1, sort_keys=True))
        with meta_file.open("rb") as handle:
            os.fsync(handle.fileno())
        try:
            os.rename(self.partial, self.final)
        except OSError:  # another builder renamed its copy first (shared storage without a working lock)
            if not (self.final / "meta.json").is_file():
                raise
            shutil.rmtree(self.partial, ignore_errors=True)
        return self.final

    def abort(self) -> None:
        for handle in (self._tokens, self._targets):
            handle.close()
        shutil.rmtree(self.partial, ignore_errors=True)


def discard(path: Path) -> None:
    """Moves an unusable entry aside and deletes it (a reader that mapped it keeps its pages)."""
    aside = path.with_name(f"{path.name}.discarded-{socket.gethostname()}-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


@dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    age_s: float

    def describe(self) -> str:
        return f"{self.host} pid {self.pid}"


def _read_holder(lock: Path) -> LockHolder | None:
    try:
        info = json.loads(lock.read_text() or "{}")
        age = time.time() - lock.stat().st_mtime
    except (OSError, ValueError):
        return None
    return LockHolder(host=str(info.get("host", "?")), pid=int(info.get("pid", -1)), age_s=age)


def _holder_is_dead(holder: LockHolder) -> bool:
    if holder.age_s > STALE_LOCK_S:
        return True
    if holder.host != socket.gethostname() or holder.pid <= 0:
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextlib.contextmanager
def _heartbeat(lock: Path) -> Iterator[None]:
    """Touches ``lock`` every ``HEARTBEAT_S`` while the body runs, so waiters can tell a live builder from a dead
    one even while a single step (reading a large file into Arrow) gives no progress callback."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(lock)

    thread = threading.Thread(target=beat, name="nemo_ac-cache-lock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def build_once(
    final: Path,
    *,
    is_complete: Callable[[], bool],
    build: Callable[[], None],
    waiting: Callable[[LockHolder], None],
    poll_s: float = 0.5,
) -> bool:
    """Runs ``build`` under ``<final>.lock`` unless ``is_complete()`` turns true first (another process built it);
    returns whether this process built. ``waiting`` is called once, with the holder, when this process waits."""
    lock = final.with_name(f"{final.name}.lock")
    told = False
    while True:
        if is_complete():
            return False
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_holder(lock)
            if holder is not None and _holder_is_dead(holder):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)  # taken over; a second waiter racing here loses the O_EXCL above
                continue
            if holder is not None and not told:
                waiting(holder)
                told = True
            time.sleep(poll_s)
            continue
        with os.fdopen(fd, "w") as handle:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}, handle)
        try:
            if is_complete():  # finished between our check and our lock
                return False
            with _heartbeat(lock):
                build()
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
