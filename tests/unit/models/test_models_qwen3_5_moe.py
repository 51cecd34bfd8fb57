"""Qwen3.5/3.6 family: packed vision-language documents, the embed/decoder split, layer contract, init, builder."""

from __future__ import annotations

import pytest
import torch

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.models.layers.mrope import multimodal_position_ids
from tests.factories import qwen3_5_config

IMAGE, VSTART, VEND = 3, 1, 2


def _cfg(**overrides) -> ModelConfig:
    settings: dict = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        partial_rotary_factor=0.75,
        layer_pattern="LAL",
        moe={"moe_intermediate_size": 8, "shared_expert_intermediate_size": 12},
        linear_attention={"num_key_heads": 1, "num_value_heads": 2, "value_head_dim": 4, "chunk_size": 4},
        vision={
            "patch_size": 2,
            "temporal_patch_size": 1,
            "num_position_embeddings": 4,
            "image_token_id": IMAGE,
            "vision_start_token_id": VSTART,
            "vision_end_token_id": VEND,
        },
    )
    settings.update(overrides)
    return qwen3_5_config(**settings)


def _model(cfg: ModelConfig | None = None):
    return materialize_and_init(build_model(cfg or _cfg()), device="cpu", seed=9)


def _document(gen: torch.Generator, grid: tuple[int, int, int], n_before: int, n_after: int) -> torch.Tensor:
    n_image = grid[0] * grid[1] * grid[2] // 4
    return torch.cat(
        (
            torch.randint(4, 64, (n_before,), generator=gen),
            torch.tensor([VSTART]),
            torch.full((n_image,), IMAGE),
            torch.tensor([VEND]),
            torch.randint(4, 64, (n_after,), generator=gen),
        )
    )


def _run(model, docs: list[torch.Tensor], pixels: list[torch.Tensor], grids: list[tuple[int, int, int]]):
    ids = torch.cat(docs).unsqueeze(0)
    position_ids = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    document_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)]).unsqueeze(0)
    return model(
        ids,
        position_ids=position_ids,
        attn=build_attention_inputs(document_ids),
        pixel_values=torch.cat(pixels),
        image_grid_thw=torch.tensor(grids),
    ).logits


def test_packed_vision_documents_equal_each_alone() -> None:
    """conv1d / recurrent-state resets, attention masking and per-document M-RoPE shifts, end to end."""
    model = _model().eval()
    gen = torch.Generator().manual_seed(0)
    grids = [(1, 4, 6), (1, 6, 4)]
    docs = [_document(gen, grids[0], 3, 6), _document(gen, grids[1], 2, 5)]
    pixels = [torch.randn(g[0] * g[1] * g[2], 3 * 2 * 2, generator=gen) for g in grids]
    with torch.no_grad():
        packed = _run(model, docs, pixels, grids)
        alone = torch.cat([_run(model, [d], [p], [g]) for d, p, g in zip(docs, pixels, grids)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)


def test_multimodal_positions_shift_only_their_document() -> None:
    ids = torch.tensor([[5, 1, 3, 3, 3, 3, 3, 3, 2, 7, 9, 1, 3, 2, 8]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]])
    docs = torch.tensor([[0] * 10 + [1] * 5])
    out = multimodal_position_ids(
        ids,
        pos,
        image_grid_thw=torch.tensor([[1, 4, 6], [1, 2, 2]]),
        image_token_id=3,
        spatial_merge_size=2,
        document_ids=docs,
    )
    # Image 1: 2x3 merged tokens starting at position 2; text resumes at 2 + max(2, 3) = 5.
    assert out[:, 0, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert out[:, 0, 8:10].tolist() == [[5, 6]] * 3
    # Document 2 is not shifted by document 1's image; its own 1x1 image keeps positions.
    assert out[:, 0, 10:].tolist() == [[0, 1, 2, 3, 4]] * 3
    with pytest.raises(ValueError, match="image_grid_thw"):
        multimodal_position_ids(
            ids, pos, image_grid_thw=torch.tensor([[1, 4, 4]]), image_token_id=3, spatial_merge_size=2
        )


def test_embed_inputs_then_decoder_equals_forward_and_trains_vision() -> None:
    model = _model()
    gen = torch.Generator().manual_seed(1)
    grid = (1, 4, 4)
    ids = _document(gen, grid, 2, 4).unsqueeze(0)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    pixels = torch.randn(16, 12, generator=gen)
    attn = build_attention_inputs(torch.zeros_like(ids))
    direct = model(ids, position_ids=pos, attn=attn, pixel_values=pixels, image_grid_thw=torch.tensor([grid]))
    emb = model.embed_inputs(ids, position_ids=pos, pixel_values=pixels, image_grid_thw=torch.tensor([grid]))
    assert emb.inputs_embeds.shape == (1, ids.shape[1], 32) and emb.position_ids.shape == (3, 1, ids.shape[1])
    split = model(None, position_ids=emb.position_ids, attn=attn, inputs_embeds=emb.inputs_embeds)
    torch.testing.assert_close(split.logits, direct.logits)
    split.logits.square().mean().backward()
    visual = model.model.visual
    assert visual.patch_embed.proj.weight.grad.abs().sum() > 0 and visual.merger.linear_fc2.weight.grad.abs().sum() > 0


def test_placeholder_count_mismatch_is_an_error() -> None:
    model = _model()
    ids = torch.tensor([[5, 1, 3, 3, 2, 6]])
    with pytest.raises(ValueError, match="image placeholder"):
        model(
            ids,
            position_ids=torch.arange(6).unsqueeze(0),
            attn=build_attention_inputs(torch.zeros_like(ids)),
            pixel_values=torch.randn(16, 12),
            image_grid_thw=torch.tensor([[1, 4, 4]]),
        )


def test_layer_contract_and_paths() -> None:
    model = build_model(_cfg())
    layers = model.model.language_model.layers
    assert [layer.layer_type for layer in layers] == ["linear_attention", "full_attention", "linear_attention"]
    for layer in layers:
        assert layer.is_moe
        for name in ("gate", "experts", "dispatcher", "shared_expert", "shared_expert_gate"):
            assert getattr(layer.mlp, name) is not None
    assert hasattr(layers[0].linear_attn, "linear_attn_op") and hasattr(layers[1].self_attn, "attn_op")
    text_only = build_model(_cfg(vision=None, layer_pattern=""))
    assert text_only.model.visual is None
    assert not any(k.startswith("model.visual") for k in text_only.state_dict())
    assert [layer.layer_type for layer in text_only.model.language_model.layers] == ["linear_attention"] * 3


def test_init_is_deterministic_and_follows_hf_conventions() -> None:
    a, b = _model().state_dict(), _model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.all(a["model.language_model.norm.weight"] == 0)  # zero-centered: scale 1 + 0
    assert torch.all(a["model.language_model.layers.1.self_attn.q_norm.weight"] == 0)
    assert torch.all(a["model.visual.blocks.0.norm1.weight"] == 1) and torch.all(
        a["model.visual.merger.norm.bias"] == 0
    )
    assert torch.all(a["model.language_model.layers.0.linear_attn.norm.weight"] == 1)
    assert a["model.visual.patch_embed.proj.weight"].std() > 0.05


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"layer_pattern": "LXL"}, "layer_pattern"),
        ({"layer_pattern": "LA"}, "layer_pattern"),
        ({"mrope_section": [2, 1, 1]}, "mrope_section"),
        ({"mrope_section": []}, "mrope_section"),
    ],
)
def test_builder_rejects_inconsistent_configs(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_model(_cfg(**overrides))
