"""Logit parity with transformers 5 ``Qwen3_5MoeForConditionalGeneration`` (text only and with images), fp32."""

from __future__ import annotations

import pytest
import torch

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from tests.factories import qwen3_5_config

transformers = pytest.importorskip("transformers", reason="transformers is not importable; HF parity needs it")
pytest.importorskip(
    "transformers.models.qwen3_5_moe", reason="this transformers has no qwen3_5_moe (needs transformers >= 5.2)"
)

IMAGE, VSTART, VEND = 5, 3, 4


def _configs(*, vision: bool) -> tuple[ModelConfig, object]:
    cfg = qwen3_5_config(
        num_layers=4,
        layer_pattern="LALL",
        rope_theta=10000.0,
        # partial_rotary_factor 0.5: rotary_dim 6 of 12 exercises the pass-through half; init_std 0.1: routing, gates
        # and attention far from uniform
        vision={
            "depth": 2 if vision else 0,
            "hidden_size": 32,
            "intermediate_size": 40,
            "image_token_id": IMAGE,
            "vision_start_token_id": VSTART,
            "vision_end_token_id": VEND,
        },  # a 3x3 position table resampled to larger grids
    )
    layer_names = {"L": "linear_attention", "A": "full_attention"}
    hf_cfg = transformers.Qwen3_5MoeConfig(
        text_config={
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.rms_norm_eps,
            "linear_conv_kernel_dim": cfg.linear_attention.conv_kernel,
            "linear_key_head_dim": cfg.linear_attention.key_head_dim,
            "linear_value_head_dim": cfg.linear_attention.value_head_dim,
            "linear_num_key_heads": cfg.linear_attention.num_key_heads,
            "linear_num_value_heads": cfg.linear_attention.num_value_heads,
            "moe_intermediate_size": cfg.moe.moe_intermediate_size,
            "shared_expert_intermediate_size": cfg.moe.shared_expert_intermediate_size,
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.num_experts_per_tok,
            "layer_types": [layer_names[c] for c in cfg.layer_pattern],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": cfg.rope_theta,
                "partial_rotary_factor": cfg.partial_rotary_factor,
                "mrope_section": cfg.mrope_section,
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": max(cfg.vision.depth, 1),
            "hidden_size": cfg.vision.hidden_size,
            "num_heads": cfg.vision.num_heads,
            "intermediate_size": cfg.vision.intermediate_size,
            "patch_size": cfg.vision.patch_size,
            "temporal_patch_size": cfg.vision.temporal_patch_size,
            "spatial_merge_size": cfg.vision.spatial_merge_size,
            "out_hidden_size": cfg.hidden_size,
            "num_position_embeddings": cfg.vision.num_position_embeddings,
        },
        image_token_id=IMAGE,
        video_token_id=6,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return cfg, hf_cfg


def _models(*, vision: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg, hf_cfg = _configs(vision=vision)
    model = materialize_and_init(build_model(cfg), device="cpu", seed=3).eval()
    with torch.no_grad():  # norms start at 0 / 1 and A_log, dt_bias at fixed values: perturb so parity tests them
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    hf = transformers.Qwen3_5MoeForConditionalGeneration(hf_cfg).eval()
    ours_sd = model.state_dict()
    hf_sd = hf.state_dict()
    expected = set(hf_sd) if vision else {k for k in hf_sd if not k.startswith("model.visual.")}
    assert set(ours_sd) == expected
    for name, value in ours_sd.items():
        assert value.shape == hf_sd[name].shape, name
    hf.load_state_dict(ours_sd, strict=vision)
    return model, hf


def test_text_logits_match_transformers() -> None:
    model, hf = _models(vision=False)
    seq = 29  # several GDN chunks (chunk_size 8) plus a ragged tail; never equal to a model dimension
    input_ids = torch.randint(7, 96, (2, seq), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(seq).unsqueeze(0).expand(2, -1)
    attn = build_attention_inputs(torch.zeros(2, seq, dtype=torch.long))
    with torch.no_grad():
        out = model(input_ids, position_ids=position_ids, attn=attn)
        ref = hf(input_ids=input_ids).logits
    err = (out.logits - ref).abs().max().item()
    print(f"text-only max |logit diff| = {err:.3e}")
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)
    assert len(out.router_stats) == 4
    assert [layer.layer_type for layer in model.model.language_model.layers] == [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
    ]


def _vl_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row, two images of different grids (t=1): text, <vs> image <ve> text, <vs> image <ve> text."""
    gen = torch.Generator().manual_seed(5)
    grids = torch.tensor([[1, 4, 6], [1, 6, 4]])  # patch grids (h, w) -> 2x3 and 3x2 merged tokens
    pieces: list[torch.Tensor] = []
    for grid in grids:
        n = int(grid.prod()) // 4
        pieces += [torch.randint(7, 96, (3,), generator=gen), torch.tensor([VSTART]), torch.full((n,), IMAGE)]
        pieces.append(torch.tensor([VEND]))
    pieces.append(torch.randint(7, 96, (5,), generator=gen))
    input_ids = torch.cat(pieces).unsqueeze(0)
    num_patches = int(grids.prod(-1).sum())
    pixel_values = torch.randn(num_patches, 3 * 2 * 4 * 4, generator=gen)
    return input_ids, pixel_values, grids


def test_image_logits_match_transformers() -> None:
    model, hf = _models(vision=True)
    input_ids, pixel_values, grids = _vl_inputs()
    seq = input_ids.shape[1]
    position_ids = torch.arange(seq).unsqueeze(0)
    attn = build_attention_inputs(torch.zeros(1, seq, dtype=torch.long))
    with torch.no_grad():
        out = model(input_ids, position_ids=position_ids, attn=attn, pixel_values=pixel_values, image_grid_thw=grids)
        ref = hf(
            input_ids=input_ids,
            pixel_values=pixel_values,
            image_grid_thw=grids,
            mm_token_type_ids=(input_ids == IMAGE).to(torch.int32),
        ).logits
        hf_positions, _ = hf.model.get_rope_index(
            input_ids, mm_token_type_ids=(input_ids == IMAGE).to(torch.int32), image_grid_thw=grids
        )
        ours = model.embed_inputs(input_ids, position_ids=position_ids, pixel_values=pixel_values, image_grid_thw=grids)
    torch.testing.assert_close(ours.position_ids, hf_positions, atol=0, rtol=0)
    err = (out.logits - ref).abs().max().item()
    print(f"with-image max |logit diff| = {err:.3e}")
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)
