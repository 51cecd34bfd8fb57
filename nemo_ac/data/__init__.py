"""Data pipeline: packed micro batches (``PackedBatch``) from synthetic tasks; knows no model and no loop."""

from nemo_ac.data.batch import IGNORE_INDEX, PackedBatch
from nemo_ac.data.loader import SyntheticBatches
from nemo_ac.data.packing import pack_row, stack_rows
from nemo_ac.data.synthetic import SyntheticTask, make_document

__all__ = [
    "IGNORE_INDEX",
    "PackedBatch",
    "SyntheticBatches",
    "SyntheticTask",
    "make_document",
    "pack_row",
    "stack_rows",
]
