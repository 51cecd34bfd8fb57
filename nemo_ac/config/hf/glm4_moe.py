"""Hugging Face ``config.json`` <-> ``ModelConfig`` for GLM-4.5 / GLM-4.5-Air (``model_type: glm4_moe``).

Grouped sigmoid routing with a score-correction bias (computed in fp32, as transformers does), ``n_shared_experts``
shared experts and partial rotary (``Glm4MoeConfig`` defaults it to 0.5). Checkpoints append their
multi-token-prediction layer(s) as ``model.layers.<num_layers + i>``; those keys are skipped on load.
"""

from __future__ import annotations

import re

from nemo_ac.config.families import FamilyProblem, FamilyRules, family_lacks, family_needs
from nemo_ac.config.hf.registry import (
    HFDict,
    HFFamily,
    first_present,
    read_common,
    read_grouped_sigmoid_routing,
    read_rope,
    register_family_rules,
    register_hf_family,
    require,
    write_common,
    write_grouped_sigmoid_routing,
)
from nemo_ac.config.schema import ModelConfig, MoEConfig


def read_glm4_moe(d: HFDict) -> ModelConfig:
    require(d, "hidden_act", "silu", "silu")
    theta, partial = read_rope(d, 0.5)  # Glm4MoeConfig defaults partial_rotary_factor to 0.5
    inter = d.get("moe_intermediate_size", 1408)
    moe = MoEConfig(
        num_experts=first_present(d, ("n_routed_experts", "num_local_experts"), 128),
        num_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=d.get("n_shared_experts", 1) * inter,
        **read_grouped_sigmoid_routing(d),
    )
    return ModelConfig(
        **read_common(d, "glm4_moe"),
        num_layers=d["num_hidden_layers"],
        first_k_dense_replace=d.get("first_k_dense_replace", 1),
        rope_theta=theta,
        partial_rotary_factor=partial,
        rms_norm_eps=d.get("rms_norm_eps", 1e-5),
        attention_bias=d.get("attention_bias", False),
        qk_norm=d.get("use_qk_norm", False),
        moe=moe,
    )


def write_glm4_moe(cfg: ModelConfig) -> HFDict:
    moe = cfg.moe
    n_shared, rest = divmod(moe.shared_expert_intermediate_size, moe.moe_intermediate_size)
    if rest:
        raise ValueError("glm4_moe: shared_expert_intermediate_size must be n_shared_experts * moe_intermediate_size")
    return {
        **write_common(cfg),
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "attention_bias": cfg.attention_bias,
        "use_qk_norm": cfg.qk_norm,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": n_shared,
        "num_experts_per_tok": moe.num_experts_per_tok,
        **write_grouped_sigmoid_routing(moe),
        "num_nextn_predict_layers": 0,
    }


def _glm_ignores(key: str, cfg: ModelConfig) -> bool:
    """GLM checkpoints append their multi-token-prediction layer(s) as model.layers.<num_layers + i>."""
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= cfg.num_layers


def glm4_moe_problems(cfg: ModelConfig) -> list[FamilyProblem]:
    """GLM-4.5's router is always sigmoid with a score-correction bias and SwiGLU experts (transformers' Glm4Moe
    has no other mode); options of other families do not exist in it."""
    moe = cfg.moe
    needs = {
        "moe.score_func": (moe.score_func, "sigmoid"),
        "moe.score_correction_bias": (moe.score_correction_bias, True),
        "moe.activation": (moe.activation, "silu"),
    }
    problems = family_needs(cfg, "glm4_moe", needs, "transformers' Glm4Moe router/experts have no other mode")
    return problems + family_lacks(
        "glm4_moe",
        {
            "attn_output_gate": cfg.attn_output_gate,
            "layer_pattern": cfg.layer_pattern,
            "moe.latent_size": moe.latent_size,
            "moe.shared_expert_gate": moe.shared_expert_gate,
            "mlp_bias": cfg.mlp_bias,
        },
    )


register_hf_family(
    HFFamily("glm4_moe", "glm4_moe", "Glm4MoeForCausalLM", read_glm4_moe, write_glm4_moe, ignore_key=_glm_ignores)
)
register_family_rules(FamilyRules("glm4_moe", problems=glm4_moe_problems))
