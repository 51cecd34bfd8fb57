"""Turn a data-pipeline micro batch into model inputs for this rank (attention metadata, CP sharding, and for
vision-language models the full-sequence embedding that precedes CP sharding)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nemo_ac.data.batch import PackedBatch
from nemo_ac.distributed.context_parallel.sharding import (
    chunks_per_rank,
    ring_attention_inputs,
    shard_positions,
    shard_sequence,
    ulysses_attention_inputs,
)
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.trainer.loop import PreparedBatch


def prepare_local_batch(batch: PackedBatch) -> PreparedBatch:
    """No context parallel: the whole sequence stays on this rank (a vision-language model embeds its images in
    its own forward)."""
    inputs = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attn": build_attention_inputs(batch.document_ids),
    }
    if batch.pixel_values is not None:
        inputs["pixel_values"] = batch.pixel_values
        inputs["image_grid_thw"] = batch.image_grid_thw
    return PreparedBatch(model_inputs=inputs, labels=batch.labels)


def embed_and_shard(model: nn.Module, *, batch: PackedBatch, positions: torch.Tensor) -> dict[str, Any]:
    """A vision-language model's decoder inputs for this CP rank: ``model.embed_inputs`` on the full micro batch
    (the vision tower needs whole images, and M-RoPE positions depend on where each image sits in its document),
    then this rank's positions of ``inputs_embeds`` [B, S, H] (dim 1) and ``position_ids`` [3, B, S] (last dim).

    Every CP rank runs the tower on the same images; backward sends each rank's shard gradient into its own
    replica, and FSDP's reduce-scatter (a sum over dp_shard x cp) adds the shards back up.
    """
    embedded = model.embed_inputs(
        batch.input_ids,
        position_ids=batch.position_ids,
        document_ids=batch.document_ids,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
    )
    index = positions.to(embedded.position_ids.device)
    return {
        "inputs_embeds": shard_sequence(embedded.inputs_embeds, positions),
        "position_ids": embedded.position_ids.index_select(embedded.position_ids.dim() - 1, index),
    }


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
    labels = shard_sequence(batch.labels, positions)
    if batch.pixel_values is not None:
        # Vision features are computed on the full sequence, right before this micro batch's forward.
        embed = functools.partial(embed_and_shard, batch=batch, positions=positions)
        return PreparedBatch(model_inputs={"input_ids": None, "attn": attn}, labels=labels, embed=embed)
    inputs = {
        "input_ids": shard_sequence(batch.input_ids, positions),
        "position_ids": shard_sequence(batch.position_ids, positions),
        "attn": attn,
    }
    return PreparedBatch(model_inputs=inputs, labels=labels)


def make_batch_preparer(
    *, cp: int, cp_rank: int = 0, cp_type: str = "ulysses"
) -> Callable[[PackedBatch], PreparedBatch]:
    """``cp == 1``: whole sequences; else this rank's (``cp_rank`` of the CP mesh) shard for ``cp_type``."""
    if cp == 1:
        return prepare_local_batch
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp})")
    return functools.partial(prepare_cp_batch, cp_size=cp, cp_rank=cp_rank, cp_type=cp_type)
