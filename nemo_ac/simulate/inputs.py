"""The rows a dry run trains on: the recipe's own data where it can be read offline, stand-in rows otherwise.

Synthetic data, local text files and MedPix's ``synthetic[:N]`` with the tiny tokenizer build exactly the batches
the run would (``nemo_ac.data.sources.build_batches``), so a tiny recipe's dry run and its real run see the same
documents. A Hub dataset or tokenizer cannot be read offline: the flagships get stand-in rows of the recipe's length
under a stated assumption (``DataAssumption``), which only shapes matter to: token values never change a shape,
documents change the attention work (packed attention counts visible pairs), images change the vision tower's work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_ac.config.schema import RecipeConfig
from nemo_ac.data.batch import IGNORE_INDEX, PackedBatch


@dataclass(frozen=True)
class DataAssumption:
    """Stand-in rows: documents of ``doc_tokens`` tokens (None: one document per row, the most attention a row can
    hold); MedPix rows hold documents of one image at ``data.image_max_pixels`` and as many text tokens."""

    doc_tokens: int | None = None

    def describe(self, recipe: RecipeConfig) -> str:
        if recipe.data.kind == "medpix":
            tokens, grid = _image_tokens(recipe)
            side = grid[1] * recipe.model.vision.patch_size
            return (
                f"stand-in MedPix rows of {recipe.data.max_length} tokens: documents of one {side}x{side} image "
                f"({tokens} image tokens, data.image_max_pixels) and as many text tokens"
            )
        length = _row_length(recipe)
        docs = "one document per row" if self.doc_tokens is None else f"documents of {self.doc_tokens} tokens"
        return f"stand-in rows of {length} tokens, {docs}, every token a loss target"


def _row_length(recipe: RecipeConfig) -> int:
    return recipe.data.max_length if recipe.data.kind == "medpix" else recipe.data.seq_len


def _offline(name: str | None) -> bool:
    """A tokenizer / dataset name nemo_ac can read without the network: built in, or a local path."""
    return name is None or name == "tiny" or Path(name).exists()


def reads_offline(recipe: RecipeConfig) -> bool:
    """Whether the recipe's own batch source builds here without the network (and without a user's code)."""
    data = recipe.data
    if data.source is not None:
        return False
    if data.kind == "synthetic":
        return True
    if not _offline(data.tokenizer):
        return False
    if data.kind == "medpix":
        return data.path is not None and (data.path.startswith("synthetic") or Path(data.path).exists())
    return data.path is not None and Path(data.path).exists()


def _image_tokens(recipe: RecipeConfig) -> tuple[int, tuple[int, int, int]]:
    vision = recipe.model.vision
    factor = vision.patch_size * vision.spatial_merge_size
    pixels = recipe.data.image_max_pixels or (32 * factor) ** 2
    side = max(factor, int(pixels**0.5) // factor * factor)
    grid = (1, side // vision.patch_size, side // vision.patch_size)
    return grid[1] * grid[2] // vision.spatial_merge_size**2, grid


def _text_row(length: int, doc_tokens: int | None, vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    doc = length if doc_tokens is None else max(1, min(doc_tokens, length))
    ids = torch.randint(4, max(vocab, 5), (length,), generator=generator)
    index = torch.arange(length)
    documents = index // doc
    positions = index % doc
    labels = torch.full_like(ids, IGNORE_INDEX)
    same = documents[1:] == documents[:-1]
    labels[:-1] = torch.where(same, ids[1:], labels[:-1])
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "document_ids": documents}


def standin_micro_batches(
    recipe: RecipeConfig, *, assumption: DataAssumption, count: int, seed: int = 0
) -> list[PackedBatch]:
    """``count`` micro batches of ``train.micro_batch_size`` stand-in rows (``DataAssumption``)."""
    generator = torch.Generator().manual_seed(seed)
    mb = recipe.train.micro_batch_size
    length = _row_length(recipe)
    vocab = recipe.model.vocab_size
    batches = []
    for _ in range(count):
        if recipe.data.kind == "medpix":
            batches.append(_medpix_batch(recipe, rows=mb, length=length, generator=generator))
            continue
        rows = [_text_row(length, assumption.doc_tokens, vocab, generator) for _ in range(mb)]
        batches.append(PackedBatch(**{key: torch.stack([r[key] for r in rows]) for key in rows[0]}))
    return batches


def _medpix_batch(recipe: RecipeConfig, *, rows: int, length: int, generator: torch.Generator) -> PackedBatch:
    """Rows of documents ``[image placeholders, text]``, each with one image of the largest allowed size."""
    vision = recipe.model.vision
    image_tokens, grid = _image_tokens(recipe)
    per_doc = min(length, 2 * image_tokens)
    docs_per_row = max(1, length // per_doc)
    row_tensors, images = [], 0
    for _ in range(rows):
        row = _text_row(length, per_doc, recipe.model.vocab_size, generator)
        for d in range(docs_per_row):
            start = d * per_doc
            row["input_ids"][start : start + image_tokens] = vision.image_token_id
            row["labels"][start : start + image_tokens] = IGNORE_INDEX
            images += 1
        row_tensors.append(row)
    patches = grid[1] * grid[2]
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return PackedBatch(
        **{key: torch.stack([r[key] for r in row_tensors]) for key in row_tensors[0]},
        pixel_values=torch.randn(images * patches, width, generator=generator),
        image_grid_thw=torch.tensor([grid] * images, dtype=torch.long),
    )
