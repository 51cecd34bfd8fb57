"""``data.kind: text``: plain-text or chat documents from JSONL, parquet, a ``save_to_disk`` directory or a Hub
dataset id, tokenized once, packed into rows with document ids.

The packing contract is the synthetic and MedPix one (``nemo_ac.data.loader``): the global batch of step ``s`` is a
pure function of ``(seed, s)``, micro batch ``k`` of dp rank ``r`` holds global rows ``[(k * dp + r) * mb, ...)``,
and the position is the next step index (``state_dict``), so a resumed run reads exactly the rows the uninterrupted
run would have read, in any parallel layout that keeps ``micro_batch_size * dp`` fixed.

How rows are made: every document is tokenized once per dataset and tokenizer, into a cache entry that every rank
and every restart memory-maps (``data.corpus``: its tokens and target flags, every token for plain text, the
assistant turns' tokens for chat, so the loss covers only what the assistant says). Epoch ``e`` orders the
documents by a permutation seeded from ``(seed, e)`` and concatenates them into one token stream; row ``i`` of the
epoch is the stream's tokens ``[i * seq_len, (i + 1) * seq_len)``, so nothing is padded and nothing is dropped
except the epoch's last partial row. A document cut by a row boundary continues in the next row as a new document
(positions restart, as for every document start). ``position_ids`` restart at each document start,
``document_ids`` number the row's documents, ``labels[t] = input_ids[t + 1]`` where ``t + 1`` is in the same
document and a target.

Bad input fails with a ``ConfigError`` naming the key and the fix: a missing column, an empty dataset, a tokenizer
larger than ``model.vocab_size``, a local file the ``datasets`` library cannot read (named by its line and byte
through ``config.data_files.diagnose_file``: a line that is not UTF-8 or not JSON), a chat recipe whose tokenizer has
no chat template. ``nemo_ac.preflight`` checks the same for a local file's head before any process group starts.

Bad rows follow one rule (``config.text_rows``): a row that cannot become a document is skipped and counted, never a
crash, whatever the reason (an empty or non-string text; a chat that is not a list of ``{role, content}`` string
turns, or has no assistant turn); one warning per reason names the file, the key and the first row numbers (rows
count from 0 in file order). Only a dataset without any usable row fails.
"""

from __future__ import annotations

import threading

import torch

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.schema import DataConfig
from nemo_ac.data.batch import PackedBatch, StepBatches
from nemo_ac.data.corpus import prepare_corpus
from nemo_ac.data.loader import stream_seed
from nemo_ac.data.packing import row_tensors, stack_rows
from nemo_ac.data.token_cache import MappedCorpus

_EPOCH_STREAM = 4


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
        corpus: MappedCorpus | None = None,
        announce: bool = False,
    ) -> None:
        self._set_layout(
            global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size
        )
        self.cfg = data_cfg
        self.seq_len = data_cfg.seq_len
        self.seed = seed
        self.corpus = (
            corpus if corpus is not None else prepare_corpus(data_cfg, vocab_size=vocab_size, announce=announce)
        )
        self.num_documents = self.corpus.num_documents
        self._lengths = self.corpus.document_lengths()
        self.total_tokens = self.corpus.total_tokens
        self.rows_per_epoch = self.total_tokens // self.seq_len
        if self.rows_per_epoch < 1:
            raise ConfigError(
                ConfigIssue(
                    "data.seq_len",
                    f"{self.seq_len} is longer than all of {data_cfg.path!r} ({self.total_tokens} tokens); lower it",
                )
            )
        self._epochs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._epochs_lock = threading.Lock()  # rows are built in data.num_workers threads too
        self.next_step = 0
        self._start_workers(data_cfg.num_workers, name="text")

    def _epoch(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(document order, cumulative token starts in that order) of ``epoch``: 16 bytes per document."""
        with self._epochs_lock:
            if epoch not in self._epochs:
                g = torch.Generator().manual_seed(stream_seed(self.seed, epoch, _EPOCH_STREAM))
                order = torch.randperm(self.num_documents, generator=g)
                starts = torch.cumsum(self._lengths[order], 0) - self._lengths[order]
                # Two epochs at a time: the micro batches of one step, built in parallel, may straddle an epoch end.
                self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
                self._epochs[epoch] = (order, starts)
            return self._epochs[epoch]

    def row(self, global_row: int) -> dict[str, torch.Tensor]:
        """Global row ``global_row`` of the run (independent of rank and layout)."""
        epoch, index = divmod(global_row, self.rows_per_epoch)
        order, starts = self._epoch(epoch)
        begin, end = index * self.seq_len, (index + 1) * self.seq_len
        d = int(torch.searchsorted(starts, torch.tensor(begin), right=True)) - 1
        ids, targets, positions, documents = [], [], [], []
        cursor, number = begin, 0
        while cursor < end:
            document = int(order[d])
            offset = cursor - int(starts[d])
            first = int(self.corpus.offsets[document]) + offset
            take = min(int(self._lengths[document]) - offset, end - cursor)
            ids.append(self.corpus.token_ids(first, first + take))
            targets.append(self.corpus.targets(first, first + take))
            positions.append(torch.arange(take))
            documents.append(torch.full((take,), number))
            cursor += take
            number += 1
            d += 1
        return row_tensors(
            ids=torch.cat(ids),
            positions=torch.cat(positions),
            documents=torch.cat(documents),
            targets=torch.cat(targets),
        )

    def micro_batch(self, step: int, first_row: int) -> PackedBatch:
        """Rows ``first_row ..`` of ``step`` (``StepBatches`` asks for them, in worker threads with num_workers)."""
        base = step * self.global_batch_size + first_row
        return stack_rows([self.row(base + i) for i in range(self.micro_batch_size)])
