"""``nemo_ac.models.freeze``: groups by module identity, requires_grad per FreezeConfig, no grads when frozen."""

from __future__ import annotations

import pytest
import torch

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models import build_model
from nemo_ac.models.freeze import freeze, parameter_groups
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from tests.factories import qwen3_5_config


def _vl_model(tie: bool = False):
    cfg = qwen3_5_config(
        vocab_size=48,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        partial_rotary_factor=1.0,
        mrope_section=[2, 1, 1],
        init_std=0.02,
        tie_word_embeddings=tie,
        moe={
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 8,
        },
        linear_attention={
            "num_key_heads": 1,
            "num_value_heads": 1,
            "key_head_dim": 4,
            "value_head_dim": 4,
            "chunk_size": 16,
        },
        # image / vision-start / vision-end ids 3 / 1 / 2: the ids of the test's image document
        vision={
            "hidden_size": 8,
            "num_heads": 1,
            "intermediate_size": 8,
            "patch_size": 2,
            "temporal_patch_size": 1,
            "num_position_embeddings": 4,
            "image_token_id": 3,
            "vision_start_token_id": 1,
            "vision_end_token_id": 2,
        },
    )
    return materialize_and_init(build_model(cfg), device="cpu", seed=0)


def _names(model, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_groups_partition_every_parameter() -> None:
    model = _vl_model()
    groups = parameter_groups(model)
    all_ids = [id(p) for params in groups.values() for p in params]
    assert len(all_ids) == len(set(all_ids)) == len(list(model.parameters()))
    assert _names(model, groups["embeddings"]) == {"model.language_model.embed_tokens.weight"}
    assert all(n.startswith("model.visual.merger.") for n in _names(model, groups["vision_merger"]))
    tower = _names(model, groups["vision_tower"])
    assert "model.visual.pos_embed.weight" in tower and not any(".merger." in n for n in tower)
    assert "lm_head.weight" in _names(model, groups["language_model"])


def test_frozen_vision_tower_gets_no_grad_and_merger_still_trains() -> None:
    model = _vl_model()
    frozen = freeze(model, vision_tower=True, embeddings=True)
    assert frozen["vision_tower"] > 0 and frozen["embeddings"] == 48 * 16 and frozen["language_model"] == 0
    ids = torch.tensor([[5, 1, 3, 2, 7, 9]])
    out = model(
        ids,
        position_ids=torch.arange(6).unsqueeze(0),
        attn=build_attention_inputs(torch.zeros_like(ids)),
        pixel_values=torch.randn(4, 12),
        image_grid_thw=torch.tensor([[1, 2, 2]]),
    )
    out.logits.sum().backward()
    for name, p in model.named_parameters():
        frozen_param = (name.startswith("model.visual.") and ".merger." not in name) or "embed_tokens" in name
        assert p.requires_grad is not frozen_param, name
        assert (p.grad is None) is frozen_param, name
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)
    optimizer.step()
    assert len(optimizer.state) == len(trainable)  # frozen tensors were never handed to the optimizer


def test_unfreeze_and_tied_embeddings() -> None:
    model = _vl_model(tie=True)
    freeze(model, language_model=True, vision_merger=True)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert model.lm_head.weight.requires_grad  # tied lm_head follows the (unfrozen) embedding group
    assert not model.model.visual.merger.linear_fc1.weight.requires_grad
    freeze(model)  # not cumulative: everything trainable again
    assert all(p.requires_grad for p in model.parameters())


def test_vision_flags_need_a_vision_tower() -> None:
    text = build_model(qwen3_5_config())  # text only
    with pytest.raises(ValueError, match=r"train\.freeze\.vision_tower"):
        freeze(text, vision_tower=True)
    frozen = freeze(build_model(ModelConfig()), language_model=True)  # any family: qwen3_moe has no visual
    assert frozen["language_model"] > 0 and frozen["embeddings"] == 0
