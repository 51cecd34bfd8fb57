"""Turn a data-pipeline micro batch into model inputs for this rank (attention metadata, CP sharding)."""

from __future__ import annotations

from collections.abc import Callable

from nemo_ac.data.batch import PackedBatch
from nemo_ac.models.common.attention import build_attention_inputs
from nemo_ac.trainer.loop import PreparedBatch


def prepare_local_batch(batch: PackedBatch) -> PreparedBatch:
    """No context parallel: the whole sequence stays on this rank."""
    inputs = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attn": build_attention_inputs(batch.document_ids),
    }
    return PreparedBatch(model_inputs=inputs, labels=batch.labels)


def make_batch_preparer(*, cp: int) -> Callable[[PackedBatch], PreparedBatch]:
    if cp > 1:
        raise NotImplementedError("parallel.cp > 1 is not available yet (context-parallel issue)")
    return prepare_local_batch
