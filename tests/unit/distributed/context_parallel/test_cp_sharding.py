"""Context-parallel input sharding: tokens, labels, positions and document ids split consistently per rank."""

from __future__ import annotations

import itertools

import pytest
import torch

from nemo_ac.config.schema import DataConfig
from nemo_ac.data.batch import IGNORE_INDEX
from nemo_ac.data.loader import SyntheticBatches
from nemo_ac.distributed.context_parallel.sharding import (
    RingAttentionInputs,
    UlyssesAttentionInputs,
    document_extents,
    shard_positions,
)
from nemo_ac.trainer.batching import make_batch_preparer, prepare_local_batch


def _batch(seq_len: int = 60):
    data = SyntheticBatches(
        DataConfig(task="sort", seq_len=seq_len, min_doc_tokens=3, max_doc_tokens=8),
        vocab_size=64,
        global_batch_size=3,
        micro_batch_size=3,
        dp_rank=0,
        dp_size=1,
        seed=5,
    )
    return data.batches_for_step(0)[0]


def test_shard_positions_ring_is_head_tail_and_ulysses_contiguous() -> None:
    assert shard_positions(12, cp_size=2, cp_rank=0, cp_type="ring").tolist() == [0, 1, 2, 9, 10, 11]
    assert shard_positions(12, cp_size=2, cp_rank=1, cp_type="ring").tolist() == [3, 4, 5, 6, 7, 8]
    assert shard_positions(12, cp_size=3, cp_rank=1, cp_type="ulysses").tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 4 \(ring CP over 2 ranks\)"):
        shard_positions(10, cp_size=2, cp_rank=0, cp_type="ring")


def test_document_extents_treat_padding_as_single_tokens() -> None:
    start, length = document_extents(torch.tensor([[0, 0, 0, 1, 1, -1, -1]]))
    assert start.tolist() == [[0, 0, 0, 3, 3, 5, 6]]
    assert length.tolist() == [[3, 3, 3, 2, 2, 1, 1]]


@pytest.mark.parametrize("cp_type", ["ring", "ulysses"])
@pytest.mark.parametrize("cp_size", [2, 3])
def test_cp_shards_partition_the_micro_batch_consistently(cp_type: str, cp_size: int) -> None:
    seq_len = 60  # ring over 3 ranks: 6 chunks of 10; never a model dimension
    batch = _batch(seq_len)
    full = prepare_local_batch(batch)
    rebuilt = {name: torch.full_like(getattr(batch, name), -7) for name in ("input_ids", "labels", "position_ids")}
    rebuilt_docs = torch.full_like(batch.document_ids, -7)
    label_tokens = 0
    for rank in range(cp_size):
        prepared = make_batch_preparer(cp=cp_size, cp_rank=rank, cp_type=cp_type)(batch)
        pos = shard_positions(seq_len, cp_size=cp_size, cp_rank=rank, cp_type=cp_type)
        inputs = prepared.model_inputs
        rebuilt["input_ids"][:, pos] = inputs["input_ids"]
        rebuilt["position_ids"][:, pos] = inputs["position_ids"]
        rebuilt["labels"][:, pos] = prepared.labels
        rebuilt_docs[:, pos] = inputs["attn"].document_ids.long()
        label_tokens += int((prepared.labels != IGNORE_INDEX).sum())
        attn = inputs["attn"]
        assert attn.document_ids.shape == (3, seq_len // cp_size)
        meta = attn.context_parallel
        assert isinstance(meta, RingAttentionInputs if cp_type == "ring" else UlyssesAttentionInputs)
        assert torch.equal(meta.document_ids.long(), batch.document_ids)
        # cu_seqlens cover the local tokens and restart at every chunk (a ring rank's chunks are not adjacent).
        chunk = seq_len // cp_size // (2 if cp_type == "ring" else 1)
        cu = attn.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == 3 * seq_len // cp_size
        assert set(range(0, 3 * seq_len // cp_size + 1, chunk)) <= set(cu)
        assert attn.max_seqlen == max(b - a for a, b in itertools.pairwise(cu))
    assert torch.equal(rebuilt["input_ids"], batch.input_ids)
    assert torch.equal(rebuilt["position_ids"], batch.position_ids)
    assert torch.equal(rebuilt["labels"], batch.labels)
    assert torch.equal(rebuilt_docs, batch.document_ids)
    assert label_tokens == int((full.labels != IGNORE_INDEX).sum())  # the loss denominator is layout independent


def test_preparer_without_cp_is_the_local_one_and_rejects_bad_rank() -> None:
    assert make_batch_preparer(cp=1) is prepare_local_batch
    with pytest.raises(ValueError, match=r"cp_rank 2 outside \[0, 2\)"):
        make_batch_preparer(cp=2, cp_rank=2, cp_type="ring")
