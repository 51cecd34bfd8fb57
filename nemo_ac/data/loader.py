"""Deterministic synthetic batches, sharded over data-parallel ranks without changing the global batch.

Row ``r`` of step ``s`` is generated from its own generator seeded by ``(seed, s, r)``, so the global batch of a
step is a pure function of ``(seed, s)`` and a rank builds only its own rows. Micro batch ``k`` of dp rank ``r``
holds global rows ``[(k * dp_size + r) * mb, (k * dp_size + r + 1) * mb)``: micro step ``k`` covers the same global
rows in every layout that keeps ``micro_batch_size * dp_size`` fixed, so per-micro-step quantities that are reduced
over ranks (the MoE load-balancing loss) match a single-process run exactly, gradient accumulation included. With ``fixed_length=False`` the
row length of a step is drawn from ``(seed, s)`` among the multiples of ``pad_multiple`` in
``[seq_len // 2, seq_len]``; all micro batches of the step share it, so every parallel layout sees the same tokens.
Resuming needs only the next step index (``state_dict``).
"""

from __future__ import annotations

import torch

from nemo_ac.config.schema import DataConfig
from nemo_ac.data.batch import PackedBatch, StepBatches
from nemo_ac.data.packing import pack_row, stack_rows
from nemo_ac.data.synthetic import SyntheticTask

_ROW_STREAM = 1
_LENGTH_STREAM = 2


def stream_seed(seed: int, step: int, stream: int, index: int = 0) -> int:
    """A 63-bit seed for one (seed, step, stream, index) tuple (splitmix64 finalizer over a simple mix)."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB + index) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**63


def length_choices(seq_len: int, pad_multiple: int) -> list[int]:
    """Multiples of ``pad_multiple`` in ``[seq_len // 2, seq_len]``."""
    lo = -(-(seq_len // 2) // pad_multiple) * pad_multiple
    choices = list(range(max(lo, pad_multiple), seq_len + 1, pad_multiple))
    if not choices:
        raise ValueError(f"no multiple of pad_multiple={pad_multiple} lies in [{seq_len // 2}, {seq_len}]")
    return choices


class SyntheticBatches(StepBatches):
    """Per-step micro batches of the synthetic task for one data-parallel rank.

    ``batches_for_step(step)`` returns ``per_rank // micro_batch_size`` ``PackedBatch`` es of
    ``micro_batch_size`` rows each. Iterating yields the lists for consecutive steps from the resume point.
    """

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
    ) -> None:
        self._set_layout(
            global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size
        )
        self.cfg = data_cfg
        self.task = SyntheticTask(
            data_cfg.task,
            vocab_size=vocab_size,
            min_doc_tokens=data_cfg.min_doc_tokens,
            max_doc_tokens=data_cfg.max_doc_tokens,
        )
        self.seed = seed
        self._lengths = None if data_cfg.fixed_length else length_choices(data_cfg.seq_len, data_cfg.pad_multiple)
        self.next_step = 0
        self._start_workers(data_cfg.num_workers, name="synthetic")

    def seq_len_for_step(self, step: int) -> int:
        if self._lengths is None:
            return self.cfg.seq_len
        g = torch.Generator().manual_seed(stream_seed(self.seed, step, _LENGTH_STREAM))
        return self._lengths[int(torch.randint(len(self._lengths), (1,), generator=g))]

    def row(self, step: int, row_index: int, seq_len: int) -> dict[str, torch.Tensor]:
        """Global row ``row_index`` of ``step`` (independent of rank and dp_size)."""
        g = torch.Generator().manual_seed(stream_seed(self.seed, step, _ROW_STREAM, row_index))
        return pack_row(lambda: self.task.sample(g), seq_len)

    def micro_batch(self, step: int, first_row: int) -> PackedBatch:
        """Rows ``first_row ..`` of ``step`` (``StepBatches`` asks for them, in worker threads with num_workers)."""
        seq_len = self.seq_len_for_step(step)
        return stack_rows([self.row(step, first_row + i, seq_len) for i in range(self.micro_batch_size)])
