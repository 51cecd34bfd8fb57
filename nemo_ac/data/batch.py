"""The micro batch the data pipeline hands to the trainer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
    over consecutive steps from ``next_step`` (the data position a checkpoint stores), which global rows its
    micro batches hold, and ``data.num_workers`` background threads. Micro batch ``k`` of dp rank ``r`` holds global
    rows ``[(k * dp + r) * mb, ...)`` of the step, so micro step ``k`` covers the same rows in every layout that
    keeps ``micro_batch_size * dp``.

    Workers (``_start_workers``): while step ``s`` trains, step ``s + 1``'s work runs in the pool. A source says how
    a step splits into jobs: by default one ``micro_batch(step, first_row)`` call per micro batch (synthetic, text);
    MedPix overrides ``_submit_step`` / ``_finish_step`` (its packing plan is sequential and stays on the calling
    thread, only the image decodes go to the pool). Which rows a job builds never depends on the thread or on
    ``num_workers``, so the batches are those of ``num_workers: 0`` bit for bit; a step asked for out of order drops
    what was prefetched, as does ``load_state_dict`` (a resume). Before, only MedPix read ``data.num_workers`` and
    text and synthetic sources silently ignored it."""

    next_step: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    grad_accum_steps: int
    _pool: ThreadPoolExecutor | None = None

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

    def _start_workers(self, num_workers: int, *, name: str) -> None:
        """``data.num_workers`` threads that build the next step while the current one trains (0: none)."""
        if num_workers < 0:
            raise ValueError(f"data.num_workers={num_workers} must be >= 0")
        self.num_workers = num_workers
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix=name) if num_workers > 0 else None
        self._prefetched: dict[int, Any] = {}

    def _run(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` in the worker pool, or now on this thread (without workers), as a future either way."""
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future[Any] = Future()
        done.set_result(fn(*args))
        return done

    def micro_batch(self, step: int, first_row: int) -> PackedBatch:
        """The micro batch of ``step`` whose first row is ``first_row`` (within the step); thread-safe."""
        raise NotImplementedError

    def _submit_step(self, step: int) -> Any:
        """The jobs of ``step`` (any nesting of lists of futures); runs on the calling thread."""
        return [self._run(self.micro_batch, step, first) for first in self.global_rows_of_micro_batches()]

    def _finish_step(self, work: Any) -> list[PackedBatch]:
        """The micro batches of ``step`` from its jobs (waits for them)."""
        return [job.result() for job in work]

    def batches_for_step(self, step: int) -> list[PackedBatch]:
        """This rank's micro batches of ``step``. With worker threads, also starts building step + 1's."""
        prefetched = self.__dict__.setdefault("_prefetched", {})
        work = prefetched.pop(step, None) or self._submit_step(step)
        self._drop_prefetched()
        if self._pool is not None:
            try:
                prefetched[step + 1] = self._submit_step(step + 1)
            except ValueError:  # e.g. nothing fits a row: raised when step + 1 itself is asked for
                self._drop_prefetched()
        return self._finish_step(work)

    def _drop_prefetched(self) -> None:
        def cancel(work: Any) -> None:
            if isinstance(work, Future):
                work.cancel()
            else:
                for item in work:
                    cancel(item)

        prefetched = self.__dict__.setdefault("_prefetched", {})
        for work in prefetched.values():
            cancel(work)
        prefetched.clear()

    def close(self) -> None:
        """Stops the worker threads (queued work is dropped)."""
        self._drop_prefetched()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def global_rows_of_micro_batches(self) -> list[int]:
        """First global row index (within the step) of each of this rank's micro batches."""
        mb = self.micro_batch_size
        return [(k * self.dp_size + self.dp_rank) * mb for k in range(self.grad_accum_steps)]

    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._drop_prefetched()  # built from the old position
        self.next_step = int(state["next_step"])

    def __iter__(self) -> Iterator[list[PackedBatch]]:
        return self

    def __next__(self) -> list[PackedBatch]:
        batches = self.batches_for_step(self.next_step)
        self.next_step += 1
        return batches
