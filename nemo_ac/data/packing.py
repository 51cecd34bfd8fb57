"""Packing documents into fixed-length rows with per-document positions, ids and answer-only labels.

A row is filled with whole documents; the last one is cut at the row end (its remainder is dropped), so rows need
no padding. For every row:
- ``position_ids`` restart at 0 at each document start (rope sees each document as if alone),
- ``document_ids`` number the documents of the row 0, 1, ... (attention stays inside a document),
- ``labels[t] = input_ids[t + 1]`` when ``t + 1`` is in the same document and in its answer part (after
  ``<sep>``, including ``<eos>``), else ``IGNORE_INDEX``. So the ``<sep>`` token predicts the first answer token
  and no label ever crosses a document boundary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_ac.data.batch import IGNORE_INDEX, PackedBatch
from nemo_ac.data.synthetic import Document


def pack_row(next_document: Callable[[], Document], seq_len: int) -> dict[str, torch.Tensor]:
    """One row of exactly ``seq_len`` tokens, drawing documents from ``next_document`` until it is full."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    ids: list[int] = []
    pos: list[int] = []
    doc: list[int] = []
    answer: list[bool] = []
    doc_index = 0
    while len(ids) < seq_len:
        d = next_document()
        take = min(len(d.tokens), seq_len - len(ids))
        ids.extend(d.tokens[:take])
        pos.extend(range(take))
        doc.extend([doc_index] * take)
        answer.extend(i >= d.answer_start for i in range(take))
        doc_index += 1
    return row_tensors(ids=ids, positions=pos, documents=doc, targets=answer)


def row_tensors(
    *,
    ids: list[int] | torch.Tensor,
    positions: list[int] | torch.Tensor,
    documents: list[int] | torch.Tensor,
    targets: list[bool] | torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One packed row's tensors: ``labels[t] = ids[t + 1]`` where ``t + 1`` is in the same document and a target."""
    input_ids = torch.as_tensor(ids, dtype=torch.long)
    document_ids = torch.as_tensor(documents, dtype=torch.long)
    is_target = torch.as_tensor(targets, dtype=torch.bool)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    keep = (document_ids[1:] == document_ids[:-1]) & is_target[1:]
    labels[:-1] = torch.where(keep, input_ids[1:], labels[:-1])
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": torch.as_tensor(positions, dtype=torch.long),
        "document_ids": document_ids,
    }


def stack_rows(rows: list[dict[str, torch.Tensor]]) -> PackedBatch:
    """Rows of equal length -> a ``PackedBatch`` of [B, S] tensors."""
    if not rows:
        raise ValueError("cannot build a batch from zero rows")
    return PackedBatch(
        input_ids=torch.stack([r["input_ids"] for r in rows]),
        labels=torch.stack([r["labels"] for r in rows]),
        position_ids=torch.stack([r["position_ids"] for r in rows]),
        document_ids=torch.stack([r["document_ids"] for r in rows]),
    )
