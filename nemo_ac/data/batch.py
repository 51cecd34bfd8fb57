"""The micro batch the data pipeline hands to the trainer."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

IGNORE_INDEX = -100


@dataclass
class PackedBatch:
    """Rows of packed documents. All tensors are [B, S].

    input_ids: token ids. labels: next-token targets, IGNORE_INDEX where no loss is taken (prompt tokens,
    the last token of each document, padding). position_ids: restart at 0 for every document.
    document_ids: index of the document within its row (attention never crosses it); -1 marks padding.
    pixel_values / image_grid_thw: optional vision inputs (vision-language families).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> PackedBatch:
        moved = {
            f.name: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }
        return PackedBatch(**moved)

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())
