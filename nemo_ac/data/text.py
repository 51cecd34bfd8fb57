"""``data.kind: text``: plain-text or chat documents from JSONL, parquet, a ``save_to_disk`` directory or a Hub
dataset id, tokenized once, packed into rows with document ids.

The packing contract is the synthetic and MedPix one (``nemo_ac.data.loader``): the global batch of step ``s`` is a
pure function of ``(seed, s)``, micro batch ``k`` of dp rank ``r`` holds global rows ``[(k * dp + r) * mb, ...)``,
and the position is the next step index (``state_dict``), so a resumed run reads exactly the rows the uninterrupted
run would have read, in any parallel layout that keeps ``micro_batch_size * dp`` fixed.

How rows are made: every document is tokenized once (its tokens and a target mask: every token for plain text,
the assistant turns' tokens for chat, so the loss covers only what the assistant says). Epoch ``e`` orders the
documents by a permutation seeded from ``(seed, e)`` and concatenates them into one token stream; row ``i`` of the
epoch is the stream's tokens ``[i * seq_len, (i + 1) * seq_len)``, so nothing is padded and nothing is dropped
except the epoch's last partial row. A document cut by a row boundary continues in the next row as a new document
(positions restart, as for every document start). ``position_ids`` restart at each document start,
``document_ids`` number the row's documents, ``labels[t] = input_ids[t + 1]`` where ``t + 1`` is in the same
document and a target.

Bad input fails with a ``ConfigError`` naming the key and the fix: a missing column, an empty dataset, a tokenizer
larger than ``model.vocab_size``, a local file the ``datasets`` library cannot read (named by its line and byte
through ``config.data_files.diagnose_file``: a line that is not UTF-8 or not JSON). ``nemo_ac.preflight`` checks the
same for a local file's head before any process group starts.

Bad rows follow one rule (``config.text_rows``): a row that cannot become a document is skipped and counted, never a
crash, whatever the reason (an empty or non-string text; a chat that is not a list of ``{role, content}`` string
turns, or has no assistant turn); one warning per reason names the file, the key and the first row numbers (rows
count from 0 in file order). Only a dataset without any usable row fails.
"""

from __future__ import annotations

import bisect
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_ac.config.data_files import diagnose_file
from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.schema import DataConfig
from nemo_ac.config.text_rows import SkippedRows, row_problem
from nemo_ac.data.batch import PackedBatch, StepBatches
from nemo_ac.data.loader import stream_seed
from nemo_ac.data.packing import row_tensors, stack_rows
from nemo_ac.data.tiny_tokenizer import TinyChatTokenizer

_EPOCH_STREAM = 4


@dataclass
class TokenizedDocument:
    tokens: list[int]
    targets: list[bool]  # token t is a loss target (predicted from t - 1)


class _TinyText:
    """The shipped byte-level tokenizer: plain text ends with ``<|im_end|>``; chat turns in its ChatML layout."""

    def __init__(self) -> None:
        self.tok = TinyChatTokenizer()
        self.vocab_size = self.tok.vocab_size

    def plain(self, text: str) -> TokenizedDocument:
        tokens = [*self.tok.encode(text), self.tok.im_end_id]
        return TokenizedDocument(tokens, [True] * len(tokens))

    def chat(self, messages: Sequence[dict[str, str]]) -> TokenizedDocument:
        tokens: list[int] = []
        targets: list[bool] = []
        for message in messages:
            head = [self.tok.im_start_id, *self.tok.encode(f"{message['role']}\n")]
            body = [*self.tok.encode(message["content"]), self.tok.im_end_id]
            assistant = message["role"] == "assistant"
            tokens += head + body + self.tok.encode("\n")
            targets += [False] * len(head) + [assistant] * len(body) + [False]
        return TokenizedDocument(tokens, targets)


class _HFText:
    """A Hugging Face tokenizer: plain text gets its EOS appended; chat uses its chat template, and the assistant
    turns are found by rendering the conversation up to each turn (the generation prompt marks where it starts)."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(name)
        self.vocab_size = len(self.tok)

    def plain(self, text: str) -> TokenizedDocument:
        tokens = list(self.tok(text, add_special_tokens=True)["input_ids"])
        if self.tok.eos_token_id is not None:
            tokens.append(self.tok.eos_token_id)
        return TokenizedDocument(tokens, [True] * len(tokens))

    def _render(self, messages: Sequence[dict[str, str]], *, prompt: bool) -> list[int]:
        out = self.tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=prompt)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def chat(self, messages: Sequence[dict[str, str]]) -> TokenizedDocument:
        tokens = self._render(messages, prompt=False)
        targets = [False] * len(tokens)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(self._render(messages[:i], prompt=True))
            end = len(self._render(messages[: i + 1], prompt=False))
            for t in range(start, min(end, len(tokens))):
                targets[t] = True
        return TokenizedDocument(tokens, targets)


def build_text_tokenizer(name: str | None) -> _TinyText | _HFText:
    """``data.tokenizer`` None / "tiny": the shipped byte-level tokenizer (vocab 262); else an HF id or dir."""
    return _TinyText() if name in (None, "tiny") else _HFText(name)


def _fail(key: str, message: str) -> ConfigError:
    return ConfigError(ConfigIssue(key, message))


def tokenize_documents(rows: Any, cfg: DataConfig, tokenizer: _TinyText | _HFText) -> list[TokenizedDocument]:
    """Every usable row as a tokenized document; the others skipped, counted and warned about per reason
    (``config.text_rows``: the same rule the preflight applies to a file's first rows)."""
    column = cfg.messages_column or cfg.text_column
    key = "data.messages_column" if cfg.messages_column else "data.text_column"
    names = list(getattr(rows, "column_names", None) or (rows[0].keys() if len(rows) else []))
    if not len(rows):
        raise _fail("data.path", f"{cfg.path!r} holds no rows (split {cfg.split!r}); point data.path at a dataset")
    if column not in names:
        raise _fail(key, f"column {column!r} is not in {cfg.path!r} (columns: {names}); set {key} to one of them")
    chat = bool(cfg.messages_column)
    docs: list[TokenizedDocument] = []
    skipped = SkippedRows()
    for index, row in enumerate(rows):
        value = row[column]
        problem = row_problem(value, chat=chat)
        if problem is not None:
            skipped.add(index, *problem)
        elif chat:
            docs.append(tokenizer.chat(value))
        else:
            docs.append(tokenizer.plain(value))
    for line in skipped.lines():
        warnings.warn(f"data.kind text: skipped rows of {cfg.path!r} ({key} {column!r}): {line}", stacklevel=2)
    if not docs:
        raise _fail(key, f"no usable rows in {cfg.path!r} ({'; '.join(skipped.lines())}); check {key} and the file")
    return docs


def _load_rows(cfg: DataConfig) -> Any:
    """The dataset's rows, through MedPix's reader of local files, ``save_to_disk`` dirs and Hub ids (a Hub id is
    fetched by local rank 0 of each node first, the others read the filled cache: ``distributed.env.once_per_node``)."""
    from nemo_ac.data.medpix import load_medpix_dataset

    if cfg.path is None:
        raise _fail(
            "data.path", "data.kind text needs data.path (a JSONL / parquet file, a save_to_disk dir or a Hub id)"
        )
    local = Path(cfg.path)
    if local.is_file() and local.stat().st_size == 0:
        raise _fail("data.path", f"{cfg.path!r} is an empty file; point data.path at a file with one document per row")
    try:
        return load_medpix_dataset(cfg.path, cfg.split)[0]
    except Exception as exc:
        if not local.exists():
            raise
        raise _unreadable(cfg, exc) from exc


def _unreadable(cfg: DataConfig, exc: Exception) -> ConfigError:
    """The ``datasets`` library names neither file nor line ("DatasetGenerationError: An error occurred while
    generating the dataset", a bare "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9 in position 3", the
    latter only when a row is read): read a local file ourselves to name them."""
    problem = diagnose_file(cfg.path) if cfg.path else None
    if problem is None:
        problem = f"{cfg.path!r} cannot be read by the datasets library: {type(exc).__name__}: {exc}"
    return _fail("data.path", problem)


def read_documents(cfg: DataConfig, tokenizer: _TinyText | _HFText) -> list[TokenizedDocument]:
    """``data.path``'s usable rows, tokenized; a file that cannot be read fails naming its line."""
    rows = _load_rows(cfg)
    try:
        return tokenize_documents(rows, cfg, tokenizer)
    except UnicodeDecodeError as exc:  # Arrow keeps a non-UTF-8 JSONL string as it is, until the row is read
        raise _unreadable(cfg, exc) from exc


class TextBatches(StepBatches):
    """Per-step micro batches of packed text documents for one data-parallel rank (the ``StepBatches``
    interface every source has: ``batches_for_step``, iteration from the resume point, ``state_dict``)."""

    def __init__(
        self,
        data_cfg: DataConfig,
        *,
        vocab_size: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        documents: list[TokenizedDocument] | None = None,
    ) -> None:
        self._set_layout(
            global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size
        )
        self.cfg = data_cfg
        self.seq_len = data_cfg.seq_len
        self.seed = seed
        if documents is None:
            tokenizer = build_text_tokenizer(data_cfg.tokenizer)
            if tokenizer.vocab_size > vocab_size:
                raise _fail(
                    "model.vocab_size",
                    f"{vocab_size} is smaller than data.tokenizer's {tokenizer.vocab_size} tokens; set "
                    f"model.vocab_size >= {tokenizer.vocab_size} or use the model's own tokenizer",
                )
            documents = read_documents(data_cfg, tokenizer)
        self.documents = documents
        self.total_tokens = sum(len(d.tokens) for d in documents)
        self.rows_per_epoch = self.total_tokens // self.seq_len
        if self.rows_per_epoch < 1:
            raise _fail(
                "data.seq_len",
                f"{self.seq_len} is longer than all of {data_cfg.path!r} ({self.total_tokens} tokens); lower it",
            )
        self._epochs: dict[int, tuple[list[int], list[int]]] = {}
        self._epochs_lock = threading.Lock()  # rows are built in data.num_workers threads too
        self.next_step = 0
        self._start_workers(data_cfg.num_workers, name="text")

    def _epoch(self, epoch: int) -> tuple[list[int], list[int]]:
        """(document order, cumulative token starts) of ``epoch``."""
        with self._epochs_lock:
            if epoch not in self._epochs:
                g = torch.Generator().manual_seed(stream_seed(self.seed, epoch, _EPOCH_STREAM))
                order = torch.randperm(len(self.documents), generator=g).tolist()
                starts, total = [], 0
                for index in order:
                    starts.append(total)
                    total += len(self.documents[index].tokens)
                # Two epochs at a time: the micro batches of one step, built in parallel, may straddle an epoch end.
                self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
                self._epochs[epoch] = (order, starts)
            return self._epochs[epoch]

    def row(self, global_row: int) -> dict[str, torch.Tensor]:
        """Global row ``global_row`` of the run (independent of rank and layout)."""
        epoch, index = divmod(global_row, self.rows_per_epoch)
        order, starts = self._epoch(epoch)
        begin, end = index * self.seq_len, (index + 1) * self.seq_len
        d = bisect.bisect_right(starts, begin) - 1
        ids: list[int] = []
        targets: list[bool] = []
        pos: list[int] = []
        doc: list[int] = []
        cursor, number = begin, 0
        while cursor < end:
            document = self.documents[order[d]]
            offset = cursor - starts[d]
            take = min(len(document.tokens) - offset, end - cursor)
            ids += document.tokens[offset : offset + take]
            targets += document.targets[offset : offset + take]
            pos += range(take)
            doc += [number] * take
            cursor += take
            number += 1
            d += 1
        return row_tensors(ids=ids, positions=pos, documents=doc, targets=targets)

    def micro_batch(self, step: int, first_row: int) -> PackedBatch:
        """Rows ``first_row ..`` of ``step`` (``StepBatches`` asks for them, in worker threads with num_workers)."""
        base = step * self.global_batch_size + first_row
        return stack_rows([self.row(base + i) for i in range(self.micro_batch_size)])
