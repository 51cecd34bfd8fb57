"""The MedPix data path meets the Qwen3.5 model: pixels as transformers' processor makes them, batches the model
accepts and learns from."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nemo_ac.config.schema import DataConfig
from nemo_ac.data.batch import IGNORE_INDEX
from nemo_ac.data.image_processing import ImagePreprocessor
from nemo_ac.data.medpix import MedPixBatches
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from tests.factories import qwen3_5_config

pytest.importorskip("PIL", reason="MedPix images need pillow (the hf extra)")


@pytest.mark.parametrize("size", [(37, 53), (16, 16), (200, 90)])
def test_pixels_match_transformers_qwen2vl_image_processor(size: tuple[int, int]) -> None:
    pil_processor = pytest.importorskip(
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", reason="transformers is not importable"
    )
    from PIL import Image

    gen = torch.Generator().manual_seed(sum(size))
    image = Image.fromarray(torch.randint(0, 256, (*size, 3), generator=gen, dtype=torch.uint8).numpy())
    kwargs = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=128, max_pixels=2048)
    hf = pil_processor.Qwen2VLImageProcessorPil(**kwargs, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    ref = hf(images=[image], return_tensors="pt")
    ours = ImagePreprocessor(**kwargs)
    pixel_values, grid = ours(image)
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert ours.num_image_tokens(*image.size) == pixel_values.shape[0] // 4
    torch.testing.assert_close(pixel_values, ref["pixel_values"], atol=1e-6, rtol=0)


def test_tiny_model_trains_on_packed_medpix_batches() -> None:
    cfg = qwen3_5_config(
        vocab_size=262,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        partial_rotary_factor=1.0,
        mrope_section=[2, 1, 1],
        init_std=0.02,
        moe={"shared_expert_intermediate_size": 16},
        linear_attention={"num_key_heads": 1, "num_value_heads": 2, "value_head_dim": 8, "chunk_size": 16},
        vision={
            "intermediate_size": 32,
            "num_position_embeddings": 16,
            "image_token_id": 3,
            "vision_start_token_id": 1,
            "vision_end_token_id": 2,
        },
    )
    vision = cfg.vision
    model = materialize_and_init(build_model(cfg), device="cpu", seed=0)
    data = MedPixBatches(
        DataConfig(kind="medpix", path="synthetic:12", max_length=136),
        vision=vision,
        global_batch_size=2,
        micro_batch_size=2,
        dp_rank=0,
        dp_size=1,
        seed=0,
    )
    (batch,) = data.batches_for_step(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        out = model(
            batch.input_ids,
            position_ids=batch.position_ids,
            attn=build_attention_inputs(batch.document_ids),
            pixel_values=batch.pixel_values,
            image_grid_thw=batch.image_grid_thw,
        )
        loss = F.cross_entropy(out.logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.8 * losses[0], losses
