"""GLM-4.5 family: logit parity with transformers 5 ``Glm4MoeForCausalLM`` and the aux-loss-free bias update."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models import build_model
from nemo_ac.models.expert_bias import biased_routers, update_expert_bias
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.models.layers.router import TopKRouter
from tests.factories import glm_config


def _hf_config(cfg: ModelConfig, transformers: object) -> object:
    moe = cfg.moe
    return transformers.Glm4MoeConfig(  # type: ignore[attr-defined]
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        partial_rotary_factor=cfg.partial_rotary_factor,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=cfg.attention_bias,
        use_qk_norm=cfg.qk_norm,
        moe_intermediate_size=moe.moe_intermediate_size,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.num_experts_per_tok,
        n_shared_experts=moe.shared_expert_intermediate_size // moe.moe_intermediate_size,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        routed_scaling_factor=moe.routed_scaling_factor,
        norm_topk_prob=moe.norm_topk_prob,
        first_k_dense_replace=cfg.first_k_dense_replace,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


@pytest.mark.parametrize("qk_norm", [False, True])
def test_logits_match_transformers(qk_norm: bool) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not importable; HF parity needs it")
    cfg = glm_config(qk_norm=qk_norm)
    model = materialize_and_init(build_model(cfg), device="cpu", seed=5).eval()
    with torch.no_grad():  # a non-zero correction bias must change selection identically in both implementations
        for router in biased_routers(model):
            router.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, cfg.moe.num_experts))
    hf = transformers.Glm4MoeForCausalLM(_hf_config(cfg, transformers)).eval()
    ours_sd = model.state_dict()
    assert set(ours_sd) == set(hf.state_dict())
    assert "model.layers.0.self_attn.q_proj.bias" in ours_sd and "model.layers.0.self_attn.o_proj.bias" not in ours_sd
    hf.load_state_dict(ours_sd, strict=True)

    seq = 21  # never equal to a model dimension
    input_ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(seq).expand(2, seq)
    with torch.no_grad():
        out = model(input_ids, position_ids=position_ids, attn=build_attention_inputs(torch.zeros(2, seq)))
        ref = hf(input_ids=input_ids, position_ids=position_ids).logits
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)
    assert len(out.router_stats) == cfg.num_layers - cfg.first_k_dense_replace
    assert [layer.is_moe for layer in model.model.layers] == [False, True, True]
    assert {type(layer.mlp.gate) for layer in model.model.layers[1:]} == {TopKRouter}


def test_builder_rejects_what_glm_does_not_have() -> None:
    with pytest.raises(ValueError, match=r"moe\.score_func='softmax' \(needs 'sigmoid'\)"):
        build_model(glm_config(moe=dataclasses.replace(glm_config().moe, score_func="softmax")))
    with pytest.raises(ValueError, match="layer_pattern"):
        build_model(glm_config(layer_pattern="**E"))


def test_update_expert_bias_rule() -> None:
    model = materialize_and_init(build_model(glm_config()), device="cpu", seed=0)
    routers = biased_routers(model)
    assert len(routers) == 2
    load = torch.tensor([[4.0, 4, 4, 4, 4, 4, 4, 4], [10.0, 0, 2, 4, 4, 6, 1, 5]])  # row means 4 and 4
    delta = update_expert_bias(model, load, rate=0.01)
    torch.testing.assert_close(routers[0].e_score_correction_bias, torch.zeros(8))  # balanced: unchanged
    expected = 0.01 * torch.tensor([-1.0, 1, 1, 0, 0, -1, 1, -1])
    torch.testing.assert_close(routers[1].e_score_correction_bias, expected)
    torch.testing.assert_close(delta[1], expected)
    update_expert_bias(model, load, rate=0.01)  # accumulates
    torch.testing.assert_close(routers[1].e_score_correction_bias, 2 * expected)
    with pytest.raises(ValueError, match=r"num_biased_moe_layers=2"):
        update_expert_bias(model, load[:1], rate=0.01)


def test_bias_updates_balance_a_skewed_router() -> None:
    """Repeated updates from observed loads even out a router whose weights favour a few experts."""
    gen = torch.Generator().manual_seed(0)
    router = TopKRouter(16, 8, 2, score_func="sigmoid", score_correction_bias=True)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=gen) * 0.3)
        router.weight[:2] += 0.2  # experts 0 and 1 win for most tokens
        router.e_score_correction_bias.zero_()
    model = torch.nn.ModuleList([router])
    tokens = torch.randn(512, 16, generator=gen).abs()

    def load() -> torch.Tensor:
        _, top_idx, _ = router(tokens)
        return torch.zeros(8).scatter_add_(0, top_idx.flatten(), torch.ones(top_idx.numel()))

    before = load()
    for _ in range(100):
        update_expert_bias(model, load().unsqueeze(0), rate=0.01)
    after = load()
    assert before.max() / before.mean() > 3.0
    assert after.max() / after.mean() < 1.5
    assert router.e_score_correction_bias[:2].max() < router.e_score_correction_bias[2:].min()
