"""Synthetic task, packing and the data-parallel batch loader."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_ac.config.schema import DataConfig
from nemo_ac.data.batch import IGNORE_INDEX, PackedBatch
from nemo_ac.data.loader import SyntheticBatches, length_choices
from nemo_ac.data.packing import pack_row
from nemo_ac.data.synthetic import BOS_ID, EOS_ID, SEP_ID, Document, SyntheticTask, make_document
from nemo_ac.models.layers.attention import build_attention_inputs

CFG = DataConfig(task="reverse", seq_len=40, min_doc_tokens=3, max_doc_tokens=7)


def _loader(dp_rank: int = 0, dp_size: int = 1, cfg: DataConfig = CFG, seed: int = 5) -> SyntheticBatches:
    return SyntheticBatches(
        cfg, vocab_size=32, global_batch_size=8, micro_batch_size=2, dp_rank=dp_rank, dp_size=dp_size, seed=seed
    )


def _cat(batches: list[PackedBatch]) -> dict[str, torch.Tensor]:
    return {
        f.name: torch.cat([getattr(b, f.name) for b in batches])
        for f in dataclasses.fields(PackedBatch)
        if getattr(batches[0], f.name) is not None
    }


def test_documents() -> None:
    assert make_document([5, 9, 7], "reverse").tokens == [BOS_ID, 5, 9, 7, SEP_ID, 7, 9, 5, EOS_ID]
    assert make_document([5, 9, 7], "copy").tokens[5:8] == [5, 9, 7]
    doc = make_document([5, 9, 7], "sort")
    assert doc.tokens[5:8] == [5, 7, 9] and doc.answer_start == 5
    task = SyntheticTask("copy", vocab_size=32, min_doc_tokens=2, max_doc_tokens=4)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    docs = [task.sample(g1) for _ in range(20)]
    assert docs == [task.sample(g2) for _ in range(20)]
    assert all(2 <= d.answer_start - 2 <= 4 and min(d.tokens[1 : d.answer_start - 1]) >= 4 for d in docs)


def test_pack_row_labels_positions_and_truncation() -> None:
    docs = iter([Document([1, 10, 11, 2, 11, 10, 3], 4), Document([1, 12, 2, 12, 3], 3), Document([1, 13, 14], 9)])
    row = pack_row(lambda: next(docs), 14)
    assert row["input_ids"].tolist() == [1, 10, 11, 2, 11, 10, 3, 1, 12, 2, 12, 3, 1, 13]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 0, 1]
    assert row["document_ids"].tolist() == [0] * 7 + [1] * 5 + [2] * 2
    x = IGNORE_INDEX
    # sep predicts the first answer token; eos is the last label; nothing crosses documents.
    assert row["labels"].tolist() == [x, x, x, 11, 10, 3, x, x, x, 12, 3, x, x, x]


def test_global_batch_independent_of_dp_size() -> None:
    """Micro step k covers the same global rows in every layout with micro_batch_size * dp_size fixed."""
    cfg = CFG

    def loader(rank: int, size: int, micro: int) -> SyntheticBatches:
        return SyntheticBatches(
            cfg, vocab_size=32, global_batch_size=8, micro_batch_size=micro, dp_rank=rank, dp_size=size, seed=5
        )

    single = loader(0, 1, 4).batches_for_step(3)  # 2 micro steps of 4 rows
    two = [loader(r, 2, 2).batches_for_step(3) for r in range(2)]  # 2 micro steps of 2 rows per rank
    for k, micro in enumerate(single):
        for key in ("input_ids", "labels", "position_ids", "document_ids"):
            joined = torch.cat([getattr(two[r][k], key) for r in range(2)])
            assert torch.equal(getattr(micro, key), joined), (k, key)
    everything = _cat(_loader().batches_for_step(3))
    four = [_cat(_loader(r, 4).batches_for_step(3)) for r in range(4)]
    for key, value in everything.items():
        rows = sorted(torch.cat([r[key] for r in four]).tolist())
        assert rows == sorted(value.tolist()), key
    assert len(_loader(1, 2).batches_for_step(0)) == 2 and _loader(1, 2).grad_accum_steps == 2


def test_batches_are_valid_and_deterministic() -> None:
    batches = _loader().batches_for_step(0)
    assert len(batches) == 4
    for b in batches:
        assert b.input_ids.shape == (2, CFG.seq_len) and b.input_ids.dtype == torch.long
        starts = b.position_ids == 0
        assert torch.equal(starts, b.input_ids == BOS_ID)  # positions restart exactly at each document
        same_doc = b.document_ids[:, 1:] == b.document_ids[:, :-1]
        assert torch.equal(same_doc, b.position_ids[:, 1:] == b.position_ids[:, :-1] + 1)
        labeled = b.labels[:, :-1] != IGNORE_INDEX
        assert torch.all(same_doc[labeled])
        assert torch.equal(b.labels[:, :-1][labeled], b.input_ids[:, 1:][labeled])
        assert torch.all(b.labels[:, -1] == IGNORE_INDEX)
        assert b.num_label_tokens > 0
        # Every labeled target is an answer token: after the document's sep.
        for r in range(b.input_ids.shape[0]):
            for t in labeled[r].nonzero().flatten().tolist():
                doc = b.document_ids[r] == b.document_ids[r, t]
                sep = ((b.input_ids[r] == SEP_ID) & doc).nonzero().flatten()
                assert sep.numel() == 1 and sep.item() <= t
        assert (b.input_ids == EOS_ID).any()
        attn = build_attention_inputs(b.document_ids)
        assert attn.cu_seqlens[-1].item() == b.input_ids.numel()
    again = _loader().batches_for_step(0)
    assert all(torch.equal(a.input_ids, c.input_ids) for a, c in zip(batches, again))
    other_seed = _loader(seed=6).batches_for_step(0)
    assert not torch.equal(batches[0].input_ids, other_seed[0].input_ids)
    assert not torch.equal(batches[0].input_ids, _loader().batches_for_step(1)[0].input_ids)


def test_variable_lengths_per_step() -> None:
    cfg = dataclasses.replace(CFG, fixed_length=False, seq_len=64, pad_multiple=8)
    assert length_choices(64, 8) == [32, 40, 48, 56, 64]
    loader = _loader(cfg=cfg)
    lengths = set()
    for step in range(12):
        batches = loader.batches_for_step(step)
        step_lens = {b.input_ids.shape[1] for b in batches}
        assert len(step_lens) == 1
        (length,) = step_lens
        assert length % 8 == 0 and 32 <= length <= 64
        assert _loader(1, 2, cfg=cfg).batches_for_step(step)[0].input_ids.shape[1] == length
        lengths.add(length)
    assert len(lengths) > 1


def test_iteration_and_resume() -> None:
    loader = _loader()
    first = [next(loader) for _ in range(3)]
    assert loader.state_dict() == {"next_step": 3}
    resumed = _loader()
    resumed.load_state_dict({"next_step": 2})
    assert torch.equal(next(iter(resumed))[0].input_ids, first[2][0].input_ids)


def test_invalid_sharding_rejected() -> None:
    with pytest.raises(ValueError, match="divisible by dp_size"):
        _loader(0, 3)
    with pytest.raises(ValueError, match="micro_batch_size"):
        SyntheticBatches(CFG, vocab_size=32, global_batch_size=8, micro_batch_size=3, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticTask("copy", vocab_size=4, min_doc_tokens=1, max_doc_tokens=2)
