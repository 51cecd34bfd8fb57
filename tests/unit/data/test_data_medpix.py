"""MedPix loader: local datasets round trip, chat layout and labels, packing / padding, dp independence, resume."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from nemo_ac.config.schema import DataConfig, VisionConfig
from nemo_ac.data.batch import IGNORE_INDEX, PackedBatch
from nemo_ac.data.medpix import MedPixBatches, load_medpix_dataset
from nemo_ac.data.medpix_sample import synthetic_medpix_records, write_synthetic_medpix
from nemo_ac.data.tiny_tokenizer import TinyChatTokenizer

pytest.importorskip("PIL", reason="MedPix images need pillow (the hf extra)")

VISION = VisionConfig(depth=1, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
TOK = TinyChatTokenizer()
RECORDS = synthetic_medpix_records(24, seed=1)


def _loader(dp_rank: int = 0, dp_size: int = 1, *, dataset=RECORDS, **data) -> MedPixBatches:
    cfg = DataConfig(kind="medpix", path="synthetic", **{"max_length": 160, **data})
    return MedPixBatches(
        cfg,
        vision=VISION,
        global_batch_size=4,
        micro_batch_size=2 // dp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=3,
        dataset=dataset,
    )


def _documents(batch: PackedBatch, row: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    docs = batch.document_ids[row]
    out = []
    for d in docs.unique().tolist():
        if d >= 0:
            sel = docs == d
            out.append((batch.input_ids[row][sel], batch.labels[row][sel], batch.position_ids[row][sel]))
    return out


def test_save_to_disk_round_trip_and_chat_layout(tmp_path) -> None:
    pytest.importorskip("datasets", reason="needs the datasets library")
    path = write_synthetic_medpix(tmp_path / "medpix", num_samples=12, seed=0)
    cfg = DataConfig(kind="medpix", path=str(path), max_length=200, packing=False)
    loader = MedPixBatches(cfg, vision=VISION, global_batch_size=2, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0)
    assert loader.columns == ("image_id", "question", "answer")  # MedPix-VQA keeps the image in image_id
    (batch,) = loader.batches_for_step(0)
    assert batch.input_ids.shape == (2, 200) and batch.pixel_values.shape[1] == 3 * 2 * 4 * 4
    assert batch.pixel_values.shape[0] == int(batch.image_grid_thw.prod(-1).sum())
    for row in range(2):
        ((ids, labels, _),) = _documents(batch, row)
        text = TOK.decode(ids.tolist())
        assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>") and "<|vision_end|>" in text
        answer = TOK.decode(labels[labels != IGNORE_INDEX].tolist())
        assert text.endswith("<|im_start|>assistant\n" + answer) and answer.endswith("<|im_end|>")
    placeholders = int((batch.input_ids == TOK.image_token_id).sum())
    assert placeholders == int(batch.image_grid_thw.prod(-1).sum()) // 4
    assert (batch.document_ids[:, -1] == -1).all() and (batch.labels[batch.document_ids < 0] == IGNORE_INDEX).all()


def test_packed_rows_restart_positions_and_never_label_across_documents() -> None:
    batch = _loader().batches_for_step(0)[0]
    docs_per_row = [len(_documents(batch, r)) for r in range(2)]
    assert min(docs_per_row) >= 2  # several short samples share a row
    for row in range(2):
        for ids, labels, pos in _documents(batch, row):
            assert pos.tolist() == list(range(len(ids)))
            assert labels[-1] == IGNORE_INDEX  # the last token of a document predicts nothing
            answer = labels != IGNORE_INDEX
            first = int(answer.nonzero()[0])
            assert torch.equal(labels[first:-1], ids[first + 1 :]) and not answer[:first].any()
    grids = batch.image_grid_thw
    assert grids.shape == (sum(docs_per_row), 3) and (grids[:, 0] == 1).all()


def test_global_batch_is_independent_of_dp_size_and_deterministic() -> None:
    (single,) = [_loader().batches_for_step(1)]
    shards = [_loader(rank, 2).batches_for_step(1) for rank in range(2)]
    # dp=1: micro batch k holds global rows [2k, 2k+2); dp=2: micro batch k of rank r holds row 2k + r.
    for k in range(2):
        for r in range(2):
            assert torch.equal(shards[r][k].input_ids[0], single[k].input_ids[r])
            assert torch.equal(shards[r][k].labels[0], single[k].labels[r])
    again = _loader().batches_for_step(1)
    assert all(torch.equal(a.pixel_values, b.pixel_values) for a, b in zip(single, again))
    assert not torch.equal(single[0].input_ids, _loader().batches_for_step(0)[0].input_ids)


def test_resume_from_state_dict_skips_replanning() -> None:
    loader = _loader()
    for _ in range(3):
        next(loader)
    state = loader.state_dict()
    expected = next(loader)
    resumed = _loader()
    resumed.load_state_dict(state)
    assert resumed.plan.base_row == 12
    got = next(resumed)
    assert all(
        torch.equal(a.input_ids, b.input_ids) and torch.equal(a.pixel_values, b.pixel_values)
        for a, b in zip(expected, got)
    )
    with pytest.raises(ValueError, match="resume point"):
        resumed.batches_for_step(0)


def test_padded_mode_truncates_long_answers_and_skips_prompts_that_do_not_fit() -> None:
    long_answer = dict(RECORDS[0], answer="x" * 500)
    batches = _loader(dataset=[long_answer, *RECORDS[1:4]], packing=False).batches_for_step(0)
    rows = torch.cat([b.document_ids for b in batches])
    assert ((rows == 0).sum(-1) >= 1).all() and ((rows > 0).sum() == 0)  # one sample per row
    full = torch.cat([b.document_ids for b in batches]) == 0
    assert full.sum(-1).max() == 160  # the long answer fills its row, its tail cut
    tiny = _loader(dataset=RECORDS[:4], packing=False, max_length=40)  # no prompt + image fits 40 tokens
    with pytest.raises(ValueError, match="max_length=40"):
        tiny.batches_for_step(0)
    assert tiny.skipped_samples == 4


def test_missing_datasets_library_names_the_key_and_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"data\.path='mmoukouba/MedPix-VQA'.*nemo_ac\[hf\]"):
        load_medpix_dataset("mmoukouba/MedPix-VQA")


def test_column_and_token_id_checks() -> None:
    with pytest.raises(ValueError, match=r"data\.question_column='prompt'"):
        _loader(question_column="prompt")
    cfg = DataConfig(kind="medpix", path="synthetic")
    with pytest.raises(ValueError, match="tiny tokenizer"):
        MedPixBatches(
            cfg,
            vision=replace(VISION, image_token_id=7),
            global_batch_size=2,
            micro_batch_size=2,
            dp_rank=0,
            dp_size=1,
            seed=0,
            dataset=RECORDS,
        )


def test_tiny_tokenizer_round_trips() -> None:
    text = "Where is the lesion? — left upper quadrant"
    assert TOK.decode(TOK.encode(text)) == text
    assert TOK.vocab_size == 262 and max(TOK.encode("\xff")) < TOK.vocab_size
