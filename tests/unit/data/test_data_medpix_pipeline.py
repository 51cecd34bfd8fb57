"""MedPix input pipeline: one decode per used image on the rank that uses it, ``data.num_workers`` threads give the
same batches as none (resume included), a Hub dataset is loaded by local rank 0 of a node before its other ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from nemo_ac.config.layout import check_batching
from nemo_ac.config.schema import DataConfig, RecipeConfig, VisionConfig
from nemo_ac.data import medpix
from nemo_ac.data.batch import PackedBatch
from nemo_ac.data.medpix import MedPixBatches
from nemo_ac.data.medpix_sample import synthetic_medpix_records, write_synthetic_medpix
from nemo_ac.runtime import once_per_node

pytest.importorskip("PIL", reason="MedPix images need pillow (the hf extra)")

VISION = VisionConfig(depth=1, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
FIELDS = [f.name for f in dataclasses.fields(PackedBatch)]


def _loader(dataset, *, dp_rank: int = 0, dp_size: int = 1, num_workers: int = 0, path: str = "synthetic"):
    cfg = DataConfig(kind="medpix", path=path, max_length=160, num_workers=num_workers)
    return MedPixBatches(
        cfg,
        vision=VISION,
        global_batch_size=2 * dp_size,
        micro_batch_size=1,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=5,
        dataset=dataset,
    )


@pytest.fixture
def pil_decodes(monkeypatch) -> list[int]:
    """Counts every pixel decode PIL does (``ImageFile.load`` on an image whose tiles are not read yet): a counter
    outside the loader, so it also sees decodes the loader does not know it causes (``datasets`` decoding a row)."""
    from PIL import ImageFile

    calls = [0]
    load = ImageFile.ImageFile.load

    def counting_load(self):
        if self.tile:
            calls[0] += 1
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    return calls


@pytest.mark.parametrize("dp_size", [1, 4])
def test_each_used_image_is_decoded_once_by_its_rank(tmp_path, pil_decodes, dp_size) -> None:
    datasets = pytest.importorskip("datasets", reason="needs the datasets library")
    path = write_synthetic_medpix(tmp_path / "medpix", num_samples=40, seed=0)
    dataset = datasets.load_from_disk(str(path))  # an Image column: decodes a PIL image on every row read
    loader = _loader(dataset, dp_rank=dp_size - 1, dp_size=dp_size)
    pil_decodes[0] = used = 0
    for _ in range(4):  # runs into the second epoch (~3 samples per row, 2 * dp rows per step)
        batches = next(loader)
        assert all(b.image_grid_thw.shape[0] == int((b.document_ids.amax(-1) + 1).sum()) for b in batches)
        used += sum(b.image_grid_thw.shape[0] for b in batches)
    assert used > 0
    assert pil_decodes[0] / used == 1.0  # 3.07 (dp 1), 5.88 (dp 4) when every row read decoded
    assert loader.decodes == loader.used_images == used


def _assert_same(a: list[list[PackedBatch]], b: list[list[PackedBatch]]) -> None:
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b):
        assert len(step_a) == len(step_b)
        for x, y in zip(step_a, step_b):
            for name in FIELDS:
                assert torch.equal(getattr(x, name), getattr(y, name)), name


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_num_workers_gives_the_batches_of_no_workers(dp_rank) -> None:
    records = synthetic_medpix_records(30, seed=2)
    plain = _loader(records, dp_rank=dp_rank, dp_size=2)
    threaded = _loader(records, dp_rank=dp_rank, dp_size=2, num_workers=2)
    try:
        expected = [next(plain) for _ in range(6)]  # past the end of the first epoch
        _assert_same(expected, [next(threaded) for _ in range(6)])
        # Step 6 is being built ahead; nothing is decoded twice: decodes = used images + those of step 6.
        ahead = [job for rows in threaded._prefetched[6] for row in rows for job in row]
        [job.result() for job in ahead]
        assert threaded.used_images == plain.used_images == plain.decodes
        assert threaded.decodes == threaded.used_images + len(ahead)
        assert threaded.batches_for_step(2) is not None  # out of order: the prefetched step is dropped, not used
    finally:
        threaded.close()


def test_resume_with_workers_continues_on_the_same_batches() -> None:
    records = synthetic_medpix_records(30, seed=2)
    reference = _loader(records)
    expected = [next(reference) for _ in range(5)]
    first = _loader(records, num_workers=2)
    _assert_same(expected[:2], [next(first) for _ in range(2)])  # step 2 is now being prefetched
    state = first.state_dict()
    first.close()
    resumed = _loader(records, num_workers=2)
    next(resumed)  # prefetches from step 0's plan, which load_state_dict must drop
    resumed.load_state_dict(state)
    try:
        _assert_same(expected[2:], [next(resumed) for _ in range(3)])
    finally:
        resumed.close()


def test_negative_num_workers_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_workers=-1"):
        _loader(synthetic_medpix_records(4), num_workers=-1)
    recipe = RecipeConfig()
    recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, num_workers=-1))
    assert [issue.key for issue in check_batching(recipe, 1)] == ["data.num_workers"]


def test_hub_dataset_is_loaded_by_local_rank_0_before_the_other_ranks(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    for local_rank in ("0", "3"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert once_per_node(lambda r=local_rank: calls.append(f"load {r}") or r) == local_rank
    assert calls == ["load 0", "barrier", "barrier", "load 3"]
    monkeypatch.setenv("LOCAL_RANK", "0")

    def fails():
        raise FileNotFoundError("no such dataset")

    calls.clear()
    with pytest.raises(FileNotFoundError):  # raised after the barrier, so the node's other ranks are not left waiting
        once_per_node(fails)
    assert calls == ["barrier"]


def test_hub_id_goes_through_once_per_node(monkeypatch) -> None:
    datasets = pytest.importorskip("datasets", reason="needs the datasets library")
    seen = []
    monkeypatch.setattr(datasets, "load_dataset", lambda path, split: [{"path": path, "split": split}])
    monkeypatch.setattr(medpix, "once_per_node", lambda load: seen.append("once") or load())
    rows, base = medpix.load_medpix_dataset("org/some-medpix", "train")
    assert seen == ["once"] and rows == [{"path": "org/some-medpix", "split": "train"}] and base is None
