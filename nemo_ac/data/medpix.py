"""MedPix-VQA batches: (image, question, answer) chat documents, packed or padded, for one data-parallel rank.

Source (``data.path``): ``synthetic`` / ``synthetic:N`` (``medpix_sample``, in memory), a ``save_to_disk``
directory, a directory or file of parquet / json / csv, or an HF dataset id (``mmoukouba/MedPix-VQA``), read with
the ``datasets`` library (imported lazily). Tokens come from ``medpix_encoding`` (tiny tokenizer or the model's
processor, ``data.tokenizer``).

Every row has exactly ``data.max_length`` tokens (static shapes for torch.compile and CP sharding). With
``data.packing`` whole samples are packed greedily into a row (position_ids restart at 0 and document_ids count
0, 1, ... per sample); otherwise a row holds one sample. The rest of a row is padding (document_id -1, no labels).
A sample longer than a row keeps its prompt and image and loses the tail of its answer; one whose prompt alone does
not fit is skipped (counted in ``skipped_samples``). Labels are next-token targets on answer tokens only.

Determinism and layout independence follow ``SyntheticBatches``: samples are read in an epoch-wise permutation
seeded by ``(seed, epoch)``; global rows are planned greedily over that stream (a plan every rank computes from token
counts alone), and micro batch ``k`` of dp rank ``r`` in step ``s`` holds global rows
``s * global_batch_size + [(k * dp + r) * mb, (k * dp + r + 1) * mb)``, so the global batch does not depend on dp.
Images of a micro batch are concatenated in row-major placeholder order (``pixel_values``, ``image_grid_thw``).
``state_dict`` stores the next step and the plan position there, so resuming does not replan from step 0.

Each image is decoded once, by the rank whose row holds it: image cells are read undecoded (a ``datasets`` Image
column is cast to ``decode=False``), the plan needs only the image size (the file header), and a sample's pixels
are made only when its row is built (``decodes`` / ``used_images`` count this). ``data.num_workers > 0`` builds the
next step's samples in that many background threads while the current step trains; which sample goes where is
fixed by the plan on the calling thread, so the batches equal those of ``num_workers: 0`` (the pool and the
prefetch are ``StepBatches``', shared with the text and synthetic sources). A Hub dataset id is
downloaded by local rank 0 of each node while the node's other ranks wait at a barrier.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from nemo_ac.config.data_files import TABULAR
from nemo_ac.config.schema import DataConfig, VisionConfig
from nemo_ac.data.batch import IGNORE_INDEX, PackedBatch, StepBatches
from nemo_ac.data.image_processing import ImagePreprocessor
from nemo_ac.data.loader import stream_seed
from nemo_ac.data.medpix_encoding import (
    EncodedSample,
    ProcessorSampleEncoder,
    SampleEncoder,
    TinySampleEncoder,
    open_image,
)
from nemo_ac.data.medpix_sample import synthetic_medpix_records
from nemo_ac.runtime import once_per_node

_EPOCH_STREAM = 3


def load_medpix_dataset(path: str, split: str = "train") -> tuple[Sequence[dict[str, Any]], Path | None]:
    """Rows of the dataset at ``path`` and the directory relative image paths resolve against (None for hub ids)."""
    if path == "synthetic" or path.startswith("synthetic:"):
        count = int(path.partition(":")[2] or 48)
        return synthetic_medpix_records(count), None
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            f"data.path={path!r}: MedPix is read with the `datasets` library, which is not installed; "
            "pip install 'nemo_ac[hf]' (or use data.path: synthetic)"
        ) from exc
    local = Path(path)
    if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(str(local))
        return (loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded), local
    if local.is_file():
        builder = TABULAR.get(local.suffix)
        if builder is None:
            raise ValueError(f"data.path={path!r}: unsupported file type (use one of {sorted(TABULAR)})")
        return datasets.load_dataset(builder, data_files=str(local), split="train"), local.parent
    if local.is_dir():
        return datasets.load_dataset(str(local), split=split), local
    return once_per_node(lambda: datasets.load_dataset(path, split=split)), None


def without_image_decoding(dataset: Sequence[dict[str, Any]], column: str) -> Sequence[dict[str, Any]]:
    """A ``datasets`` dataset whose Image column ``column`` yields ``{"bytes", "path"}`` instead of a decoded PIL
    image (reading a row then costs no decode; ``open_image`` opens it lazily). Anything else is returned as is."""
    feature = (getattr(dataset, "features", None) or {}).get(column)
    if getattr(feature, "decode", False) and dataclasses.is_dataclass(feature) and hasattr(dataset, "cast_column"):
        return dataset.cast_column(column, dataclasses.replace(feature, decode=False))
    return dataset


def build_encoder(data_cfg: DataConfig, vision: VisionConfig) -> SampleEncoder:
    """``data.tokenizer`` None / "tiny": the shipped byte-level tokenizer; anything else: the model's processor."""
    if data_cfg.tokenizer in (None, "tiny"):
        images = ImagePreprocessor(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
            min_pixels=data_cfg.image_min_pixels,
            max_pixels=data_cfg.image_max_pixels or 32 * 32,
        )
        encoder = TinySampleEncoder(images)
        ids = (encoder.image_token_id, encoder.vision_start_id, encoder.vision_end_id)
        expected = (vision.image_token_id, vision.vision_start_token_id, vision.vision_end_token_id)
        if ids != expected:
            raise ValueError(
                f"the tiny tokenizer's (image, vision_start, vision_end) ids are {ids} but model.vision has {expected}"
            )
        return encoder
    return ProcessorSampleEncoder(
        data_cfg.tokenizer,
        image_token_id=vision.image_token_id,
        min_pixels=data_cfg.image_min_pixels,
        max_pixels=data_cfg.image_max_pixels,
    )


class PackingPlan:
    """Greedy assignment of the sample stream to global rows, from token counts alone.

    ``lengths(i)`` gives ``(tokens, answer_start)`` of stream sample ``i``. Rows are planned in order and cached;
    ``base_row`` / ``base_cursor`` let a resumed run start planning at a later row.
    """

    def __init__(self, lengths: Callable[[int], tuple[int, int]], *, max_length: int, packing: bool, epoch_size: int):
        self.lengths = lengths
        self.max_length = max_length
        self.packing = packing
        self.epoch_size = epoch_size
        self.reset(0, 0)

    def reset(self, base_row: int, base_cursor: int) -> None:
        self.base_row = base_row
        self.cursor = base_cursor
        self.rows: list[list[tuple[int, int]]] = []  # per row: (stream index, tokens kept)
        self.skipped = 0
        self._pending: tuple[int, int] | None = None

    def _kept(self, index: int) -> int | None:
        total, answer_start = self.lengths(index)
        if total <= self.max_length:
            return total
        return self.max_length if answer_start + 1 <= self.max_length else None

    def _next_sample(self) -> tuple[int, int]:
        for _ in range(self.epoch_size):
            index = self.cursor
            self.cursor += 1
            kept = self._kept(index)
            if kept is not None:
                return index, kept
            self.skipped += 1
        raise ValueError(f"no sample in a whole epoch fits data.max_length={self.max_length} (prompt + image)")

    def row(self, global_row: int) -> list[tuple[int, int]]:
        if global_row < self.base_row:
            raise ValueError(f"row {global_row} precedes the resume point (row {self.base_row}) of this loader")
        while len(self.rows) <= global_row - self.base_row:
            first = self._pending or self._next_sample()
            items, used, self._pending = [first], first[1], None
            while self.packing:
                candidate = self._next_sample()
                if used + candidate[1] > self.max_length:
                    self._pending = candidate
                    break
                items.append(candidate)
                used += candidate[1]
            self.rows.append(items)
        return self.rows[global_row - self.base_row]

    def position(self, global_row: int) -> int:
        """Stream index of the first sample of ``global_row`` (plans up to it)."""
        return self.row(global_row)[0][0]


class MedPixBatches(StepBatches):
    """Per-step micro batches of MedPix documents for one dp rank; same interface as ``SyntheticBatches``."""

    def __init__(
        self,
        data_cfg: DataConfig,
        *,
        vision: VisionConfig,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        dataset: Sequence[dict[str, Any]] | None = None,
        encoder: SampleEncoder | None = None,
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if global_batch_size % (dp_size * micro_batch_size):
            raise ValueError(
                f"global_batch_size={global_batch_size} must be divisible by dp_size * micro_batch_size = "
                f"{dp_size} * {micro_batch_size}"
            )
        base_dir = None
        if dataset is None:
            if not data_cfg.path:
                raise ValueError("data.path: medpix needs a local path, an HF dataset id or 'synthetic'")
            dataset, base_dir = load_medpix_dataset(data_cfg.path, data_cfg.split)
        if len(dataset) == 0:
            raise ValueError(f"data.path={data_cfg.path!r} (split {data_cfg.split!r}) has no rows")
        self.columns = self._columns(data_cfg, dataset)
        self.dataset = without_image_decoding(dataset, self.columns[0])
        self.base_dir = base_dir
        self.encoder = encoder or build_encoder(data_cfg, vision)
        self.max_length = data_cfg.max_length
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.grad_accum_steps = global_batch_size // (dp_size * micro_batch_size)
        self.seed = seed
        self._perms: dict[int, list[int]] = {}
        self.plan = PackingPlan(
            self._lengths, max_length=data_cfg.max_length, packing=data_cfg.packing, epoch_size=len(dataset)
        )
        self.next_step = 0
        self.decodes = 0  # images whose pixels this loader decoded and preprocessed
        self.used_images = 0  # images in the micro batches it returned
        self._count_lock = threading.Lock()
        self._start_workers(data_cfg.num_workers, name="medpix")  # StepBatches: the next step's decodes, in threads

    @staticmethod
    def _columns(data_cfg: DataConfig, dataset: Sequence[dict[str, Any]]) -> tuple[str, str, str]:
        names = list(getattr(dataset, "column_names", None) or dataset[0].keys())
        image = data_cfg.image_column
        if image == "auto":
            image = "image" if "image" in names else "image_id"
        cols = (image, data_cfg.question_column, data_cfg.answer_column)
        keys = ("data.image_column", "data.question_column", "data.answer_column")
        for key, col in zip(keys, cols):
            if col not in names:
                raise ValueError(f"{key}={col!r} is not a column of the dataset (columns: {names})")
        return cols

    def _dataset_index(self, stream_index: int) -> int:
        n = len(self.dataset)
        epoch, offset = divmod(stream_index, n)
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(stream_seed(self.seed, epoch, _EPOCH_STREAM))
            perm = torch.randperm(n, generator=gen).tolist()
            # Two epochs cached: planning may run into the next epoch while batches still read the current one.
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = perm
        return perm[offset]

    def _cells(self, stream_index: int) -> tuple[Any, str, str]:
        """The (image cell, question, answer) of a stream sample; the image cell is not decoded."""
        record = self.dataset[self._dataset_index(stream_index)]
        image_col, question_col, answer_col = self.columns
        return record[image_col], str(record[question_col]), str(record[answer_col])

    def _lengths(self, stream_index: int) -> tuple[int, int]:
        """(tokens, answer_start) from the text and the image size (its header), without decoding pixels."""
        cell, question, answer = self._cells(stream_index)
        image = open_image(cell, self.base_dir)
        try:
            return self.encoder.num_tokens(image, question, answer)
        finally:
            if image is not cell:
                image.close()

    def _encode_cells(self, cells: tuple[Any, str, str], kept: int) -> EncodedSample:
        """One sample's tokens and pixels (the one decode of its image); thread-safe, runs in the worker pool."""
        cell, question, answer = cells
        image = open_image(cell, self.base_dir)
        try:
            planned = self.encoder.num_tokens(image, question, answer)
            sample = self.encoder.encode(image, question, answer)
        finally:
            if image is not cell:
                image.close()
        with self._count_lock:
            self.decodes += 1
        if (len(sample.input_ids), sample.answer_start) != planned:
            raise RuntimeError(f"encoder made {len(sample.input_ids)} tokens for a sample planned as {planned}")
        sample.input_ids = sample.input_ids[:kept]
        return sample

    def _encode(self, stream_index: int, kept: int) -> EncodedSample:
        return self._encode_cells(self._cells(stream_index), kept)

    def _submit_row(self, global_row: int) -> list[Future[EncodedSample]]:
        """Plans ``global_row`` on this thread and hands its samples' encoding to the pool (or does it now)."""
        return [self._run(self._encode_cells, self._cells(index), kept) for index, kept in self.plan.row(global_row)]

    def _submit_step(self, step: int) -> list[list[list[Future[EncodedSample]]]]:
        """Per micro batch, per row: the futures of its samples, in plan order (the plan runs on this thread)."""
        base = step * self.global_batch_size
        return [
            [self._submit_row(base + first + i) for i in range(self.micro_batch_size)]
            for first in self.global_rows_of_micro_batches()
        ]

    def _row_tensors(self, samples: list[EncodedSample]) -> dict[str, torch.Tensor]:
        """A row's [max_length] tensors from its (already truncated) samples."""
        ids: list[int] = []
        labels: list[int] = []
        pos: list[int] = []
        docs: list[int] = []
        for doc, sample in enumerate(samples):
            tokens = sample.input_ids
            ids += tokens
            labels += [t if i + 1 >= sample.answer_start else IGNORE_INDEX for i, t in enumerate(tokens[1:])]
            labels.append(IGNORE_INDEX)
            pos += range(len(tokens))
            docs += [doc] * len(tokens)
        pad = self.max_length - len(ids)
        ids += [self.encoder.pad_id] * pad
        labels += [IGNORE_INDEX] * pad
        pos += range(pad)
        docs += [-1] * pad
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "position_ids": torch.tensor(pos, dtype=torch.long),
            "document_ids": torch.tensor(docs, dtype=torch.long),
        }

    def row(self, global_row: int) -> tuple[dict[str, torch.Tensor], list[EncodedSample]]:
        """Global row ``global_row``'s [max_length] tensors and its samples (for their pixels)."""
        samples = [self._encode(index, kept) for index, kept in self.plan.row(global_row)]
        return self._row_tensors(samples), samples

    def _assemble(self, rows: list[list[EncodedSample]]) -> PackedBatch:
        tensors = [self._row_tensors(samples) for samples in rows]
        samples = [s for row_samples in rows for s in row_samples]
        with self._count_lock:
            self.used_images += len(samples)
        return PackedBatch(
            input_ids=torch.stack([r["input_ids"] for r in tensors]),
            labels=torch.stack([r["labels"] for r in tensors]),
            position_ids=torch.stack([r["position_ids"] for r in tensors]),
            document_ids=torch.stack([r["document_ids"] for r in tensors]),
            pixel_values=torch.cat([s.pixel_values for s in samples]),
            image_grid_thw=torch.tensor([s.grid_thw for s in samples], dtype=torch.long),
        )

    def micro_batch(self, step: int, first_row: int) -> PackedBatch:
        base = step * self.global_batch_size + first_row
        return self._assemble([self.row(base + i)[1] for i in range(self.micro_batch_size)])

    def _finish_step(self, work: list[list[list[Future[EncodedSample]]]]) -> list[PackedBatch]:
        return [self._assemble([[job.result() for job in row] for row in rows]) for rows in work]

    @property
    def skipped_samples(self) -> int:
        return self.plan.skipped

    def state_dict(self) -> dict[str, Any]:
        row = self.next_step * self.global_batch_size
        return {"next_step": self.next_step, "plan_row": row, "plan_cursor": self.plan.position(row)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._drop_prefetched()  # planned from the old position
        self.next_step = int(state["next_step"])
        if "plan_row" in state:
            self.plan.reset(int(state["plan_row"]), int(state["plan_cursor"]))
