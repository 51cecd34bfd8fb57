"""Hugging Face ``config.json`` <-> ``ModelConfig`` for Qwen3 MoE (``model_type: qwen3_moe``).

Softmax routing without a shared expert, q/k norms, and an optional dense prefix (``mlp_only_layers=[0..k-1]``,
``decoder_sparse_step=1``; other sparse-step layouts raise). Checkpoint keys need no renaming.
"""

from __future__ import annotations

from nemo_ac.config.families import FamilyRules
from nemo_ac.config.hf.registry import (
    HFDict,
    HFFamily,
    first_present,
    read_common,
    read_rope,
    register_family_rules,
    register_hf_family,
    require,
    write_common,
)
from nemo_ac.config.schema import ModelConfig, MoEConfig


def read_qwen3_moe(d: HFDict) -> ModelConfig:
    require(d, "hidden_act", "silu", "silu")
    mlp_only = sorted(d.get("mlp_only_layers") or [])
    if d.get("decoder_sparse_step", 1) != 1 or mlp_only != list(range(len(mlp_only))):
        raise NotImplementedError("qwen3_moe: only a dense prefix (mlp_only_layers=[0..k-1], decoder_sparse_step=1)")
    theta, partial = read_rope(d, 1.0)
    moe = MoEConfig(
        # transformers 5 saves num_local_experts
        num_experts=first_present(d, ("num_experts", "num_local_experts"), 128),
        num_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_intermediate_size=d.get("moe_intermediate_size", 768),
        norm_topk_prob=d.get("norm_topk_prob", False),
        score_func="softmax",
    )
    return ModelConfig(
        **read_common(d, "qwen3_moe"),
        num_layers=d["num_hidden_layers"],
        first_k_dense_replace=len(mlp_only),
        rope_theta=theta,
        partial_rotary_factor=partial,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        attention_bias=d.get("attention_bias", False),
        qk_norm=True,
        moe=moe,
    )


def write_qwen3_moe(cfg: ModelConfig) -> HFDict:
    moe = cfg.moe
    if moe.shared_expert_intermediate_size or moe.score_func != "softmax" or not cfg.qk_norm:
        raise ValueError("qwen3_moe has no shared expert, softmax routing and qk-norm only")
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
        "attention_bias": cfg.attention_bias,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.first_k_dense_replace)),
        "moe_intermediate_size": moe.moe_intermediate_size,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "norm_topk_prob": moe.norm_topk_prob,
    }


register_hf_family(HFFamily("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", read_qwen3_moe, write_qwen3_moe))
register_family_rules(FamilyRules("qwen3_moe"))
