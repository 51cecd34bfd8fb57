"""Logit parity with transformers 5 ``Qwen3MoeForCausalLM``: same names, same math."""

from __future__ import annotations

import pytest
import torch

from nemo_ac.config.schema import ModelConfig, MoEConfig
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs

transformers = pytest.importorskip("transformers", reason="transformers is not importable; HF parity needs it")


def _configs(first_k_dense_replace: int = 0) -> tuple[ModelConfig, object]:
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        first_k_dense_replace=first_k_dense_replace,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        init_std=0.1,  # larger than default so routing and attention are far from uniform
        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    )
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        moe_intermediate_size=cfg.moe.moe_intermediate_size,
        num_experts=cfg.moe.num_experts,
        num_experts_per_tok=cfg.moe.num_experts_per_tok,
        norm_topk_prob=True,
        mlp_only_layers=list(range(first_k_dense_replace)),
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=False,
        attention_bias=False,
        attn_implementation="sdpa",
    )
    return cfg, hf_cfg


@pytest.mark.parametrize("first_k_dense_replace", [0, 1])
def test_logits_match_transformers(first_k_dense_replace: int) -> None:
    cfg, hf_cfg = _configs(first_k_dense_replace)
    model = materialize_and_init(build_model(cfg), device="cpu", seed=7).eval()
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()

    ours_sd = model.state_dict()
    assert set(ours_sd) == set(hf.state_dict())
    hf.load_state_dict(ours_sd, strict=True)

    seq = 21  # never equal to a model dimension
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=gen)
    position_ids = torch.arange(seq).unsqueeze(0)
    attn = build_attention_inputs(torch.zeros(1, seq, dtype=torch.long))
    with torch.no_grad():
        out = model(input_ids, position_ids=position_ids, attn=attn)
        ref = hf(input_ids=input_ids, position_ids=position_ids).logits
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)
    assert len(out.router_stats) == cfg.num_layers - first_k_dense_replace
    assert [layer.is_moe for layer in model.model.layers] == [i >= first_k_dense_replace for i in range(cfg.num_layers)]
