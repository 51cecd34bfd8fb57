"""The micro batch the data pipeline hands to the trainer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

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


class StepBatches:
    """What every batch source shares: this rank's micro batches of step ``s`` (``batches_for_step``), iteration
    over consecutive steps from ``next_step`` (the data position a checkpoint stores), and which global rows its
    micro batches hold. Micro batch ``k`` of dp rank ``r`` holds global rows ``[(k * dp + r) * mb, ...)`` of the
    step, so micro step ``k`` covers the same rows in every layout that keeps ``micro_batch_size * dp``."""

    next_step: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    grad_accum_steps: int

    def _set_layout(self, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
        """Checks and stores how the global batch splits over dp ranks and micro batches."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if global_batch_size % dp_size:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}")
        per_rank = global_batch_size // dp_size
        if micro_batch_size < 1 or per_rank % micro_batch_size:
            raise ValueError(
                f"per-rank batch {per_rank} (global_batch_size {global_batch_size} / dp_size {dp_size}) is not "
                f"divisible by micro_batch_size={micro_batch_size}"
            )
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = per_rank
        self.grad_accum_steps = per_rank // micro_batch_size

    def batches_for_step(self, step: int) -> list[PackedBatch]:
        raise NotImplementedError

    def global_rows_of_micro_batches(self) -> list[int]:
        """First global row index (within the step) of each of this rank's micro batches."""
        mb = self.micro_batch_size
        return [(k * self.dp_size + self.dp_rank) * mb for k in range(self.grad_accum_steps)]

    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_step = int(state["next_step"])

    def __iter__(self) -> Iterator[list[PackedBatch]]:
        return self

    def __next__(self) -> list[PackedBatch]:
        batches = self.batches_for_step(self.next_step)
        self.next_step += 1
        return batches
