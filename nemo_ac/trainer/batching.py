"""Turn a data-pipeline micro batch into model inputs for this rank (attention metadata, CP sharding)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from nemo_ac.data.batch import PackedBatch
from nemo_ac.distributed.context_parallel.sharding import (
    chunks_per_rank,
    ring_attention_inputs,
    shard_positions,
    shard_sequence,
    ulysses_attention_inputs,
)
from nemo_ac.models.common.attention import build_attention_inputs
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.trainer.loop import PreparedBatch


def prepare_local_batch(batch: PackedBatch) -> PreparedBatch:
    """No context parallel: the whole sequence stays on this rank."""
    inputs = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attn": build_attention_inputs(batch.document_ids),
    }
    return PreparedBatch(model_inputs=inputs, labels=batch.labels)


def prepare_cp_batch(batch: PackedBatch, *, cp_size: int, cp_rank: int, cp_type: str) -> PreparedBatch:
    """This CP rank's slice of a micro batch every CP rank received whole.

    Tokens, labels, rope positions and document ids are cut at the same global positions (labels were shifted
    before sharding, so no label crosses a shard). The loss stays exact: each label token lives on exactly one CP
    rank, and the trainer divides by the label tokens summed over all ranks.

    ``AttentionInputs`` describe the local shard; ``cu_seqlens`` restart at every chunk (a ring rank's two chunks are
    not contiguous in the sequence). ``context_parallel`` carries what the CP op needs from the full rows.
    """
    b, s = batch.input_ids.shape
    positions = shard_positions(s, cp_size=cp_size, cp_rank=cp_rank, cp_type=cp_type, device=batch.input_ids.device)
    local_docs = shard_sequence(batch.document_ids, positions)
    chunks = chunks_per_rank(cp_type)
    per_chunk = build_attention_inputs(local_docs.reshape(b * chunks, -1))
    if cp_type == "ring":
        meta = ring_attention_inputs(batch.document_ids, cp_size=cp_size, cp_rank=cp_rank)
    else:
        meta = ulysses_attention_inputs(batch.document_ids)
    attn = AttentionInputs(
        document_ids=local_docs.to(torch.int32),
        cu_seqlens=per_chunk.cu_seqlens,
        max_seqlen=per_chunk.max_seqlen,
        context_parallel=meta,
    )
    inputs = {
        "input_ids": shard_sequence(batch.input_ids, positions),
        "position_ids": shard_sequence(batch.position_ids, positions),
        "attn": attn,
    }
    return PreparedBatch(model_inputs=inputs, labels=shard_sequence(batch.labels, positions))


def make_batch_preparer(
    *, cp: int, cp_rank: int = 0, cp_type: str = "ulysses"
) -> Callable[[PackedBatch], PreparedBatch]:
    """``cp == 1``: whole sequences; else this rank's (``cp_rank`` of the CP mesh) shard for ``cp_type``."""
    if cp == 1:
        return prepare_local_batch
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp})")
    return functools.partial(prepare_cp_batch, cp_size=cp, cp_rank=cp_rank, cp_type=cp_type)
