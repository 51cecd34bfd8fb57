"""Hugging Face ``config.json`` <-> ``ModelConfig`` for Nemotron-H / Nemotron 3 (``model_type: nemotron_h``).

The layer layout is ``hybrid_override_pattern`` (or transformers 5's ``layers_block_type``, mapped back onto the
pattern characters); ``NemotronHConfig``'s legacy ``mamba_*`` aliases are read too. Hub checkpoints say
``backbone.`` where transformers 5 and nemo_ac say ``model.`` (``key_renames``), and keep multi-token-prediction
weights under a top-level ``mtp.`` prefix, skipped on load.
"""

from __future__ import annotations

from nemo_ac.config.families import FamilyProblem, FamilyRules, HeadGroup, RecurrentMixer, family_needs
from nemo_ac.config.hf.registry import (
    HFDict,
    HFFamily,
    first_present,
    read_common,
    read_grouped_sigmoid_routing,
    register_family_rules,
    register_hf_family,
    require,
    write_common,
    write_grouped_sigmoid_routing,
)
from nemo_ac.config.schema import MambaConfig, ModelConfig, MoEConfig

# transformers 5 layer types (and their legacy names) -> hybrid_override_pattern characters.
_PATTERN_OF_TYPE = {
    "mamba": "M",
    "linear_attention": "M",
    "attention": "*",
    "full_attention": "*",
    "moe": "E",
    "mlp": "-",
}


def _nemotron_pattern(d: HFDict) -> str:
    if d.get("hybrid_override_pattern"):
        return str(d["hybrid_override_pattern"])
    types = d.get("layers_block_type") or d.get("layer_types")
    if not types:
        raise ValueError("nemotron_h config.json has neither hybrid_override_pattern nor layers_block_type")
    unknown = sorted(set(types) - set(_PATTERN_OF_TYPE))
    if unknown:
        raise NotImplementedError(f"nemotron_h layer types {unknown} are not implemented")
    return "".join(_PATTERN_OF_TYPE[t] for t in types)


def read_nemotron_h(d: HFDict) -> ModelConfig:
    require(d, "mamba_hidden_act", "silu", "silu")
    require(d, "mlp_hidden_act", "relu2", "relu2")
    pattern = _nemotron_pattern(d)
    mamba = MambaConfig(
        num_heads=d.get("mamba_num_heads", 128),
        head_dim=d.get("mamba_head_dim", 64),
        state_size=d.get("ssm_state_size", 128),
        n_groups=first_present(d, ("n_groups", "mamba_n_groups"), 8),
        conv_kernel=first_present(d, ("conv_kernel", "mamba_d_conv"), 4),
        chunk_size=first_present(d, ("chunk_size", "mamba_chunk_size"), 128),
        expand=first_present(d, ("expand", "mamba_expand"), 2),
        conv_bias=first_present(d, ("use_conv_bias", "mamba_conv_bias"), True),
        proj_bias=d.get("use_bias", False),
        time_step_min=first_present(d, ("time_step_min", "mamba_dt_min"), 0.001),
        time_step_max=first_present(d, ("time_step_max", "mamba_dt_max"), 0.1),
        time_step_floor=first_present(d, ("time_step_floor", "mamba_dt_init_floor"), 1e-4),
    )
    moe = MoEConfig(
        num_experts=first_present(d, ("n_routed_experts", "num_local_experts"), 8),
        num_experts_per_tok=d.get("num_experts_per_tok", 2),
        moe_intermediate_size=d.get("moe_intermediate_size", 7688),
        # transformers: NemotronHMLP(intermediate_size=moe_shared_expert_intermediate_size or intermediate_size).
        shared_expert_intermediate_size=d.get("moe_shared_expert_intermediate_size") or d["intermediate_size"],
        latent_size=d.get("moe_latent_size") or 0,
        **read_grouped_sigmoid_routing(d),
        activation="relu2",
    )
    return ModelConfig(
        **read_common(d, "nemotron_h"),
        num_layers=len(pattern),
        layer_pattern=pattern,
        rms_norm_eps=d.get("layer_norm_epsilon", 1e-5),
        # NemotronHAttention has no rope, no qk-norm and never a bias (it ignores attention_bias).
        qk_norm=False,
        attention_bias=False,
        mlp_bias=d.get("mlp_bias", False),
        mamba=mamba,
        moe=moe,
    )


def write_nemotron_h(cfg: ModelConfig) -> HFDict:
    m, moe = cfg.mamba, cfg.moe
    return {
        **write_common(cfg),
        "hybrid_override_pattern": cfg.layer_pattern,
        "num_hidden_layers": cfg.num_layers,
        "layer_norm_epsilon": cfg.rms_norm_eps,
        "mlp_hidden_act": "relu2",
        "mlp_bias": cfg.mlp_bias,
        "attention_bias": False,
        "mamba_hidden_act": "silu",
        "mamba_num_heads": m.num_heads,
        "mamba_head_dim": m.head_dim,
        "ssm_state_size": m.state_size,
        "n_groups": m.n_groups,
        "conv_kernel": m.conv_kernel,
        "chunk_size": m.chunk_size,
        "expand": m.expand,
        "use_conv_bias": m.conv_bias,
        "use_bias": m.proj_bias,
        "time_step_min": m.time_step_min,
        "time_step_max": m.time_step_max,
        "time_step_floor": m.time_step_floor,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
        "moe_latent_size": moe.latent_size or None,
        **write_grouped_sigmoid_routing(moe),
        "num_nextn_predict_layers": 0,
    }


def _nemotron_ignores(key: str, cfg: ModelConfig) -> bool:
    """Nemotron 3 checkpoints keep multi-token-prediction weights under a top-level ``mtp.`` prefix."""
    return key.startswith("mtp.")


def nemotron_h_problems(cfg: ModelConfig) -> list[FamilyProblem]:
    """Nemotron-H attention has no rope, qk-norm or bias; its MoE is sigmoid + correction bias with squared-ReLU
    experts and always-on shared experts; layer types come from ``layer_pattern`` only (its characters and length
    are checked by ``rules_model.check_model_shape``; the builder re-checks them)."""
    moe = cfg.moe
    problems = []
    if not cfg.layer_pattern:
        problems.append(
            FamilyProblem(
                "model.layer_pattern",
                "",
                None,
                "family nemotron_h needs its hybrid_override_pattern, one of M * E - per layer, e.g. 'ME*E'",
            )
        )
    needs = {
        "moe.score_func": (moe.score_func, "sigmoid"),
        "moe.score_correction_bias": (moe.score_correction_bias, True),
        "moe.activation": (moe.activation, "relu2"),
        "qk_norm": (cfg.qk_norm, False),
        "attention_bias": (cfg.attention_bias, False),
        "first_k_dense_replace": (cfg.first_k_dense_replace, 0),
        "attn_output_gate": (cfg.attn_output_gate, False),
        "moe.shared_expert_gate": (moe.shared_expert_gate, False),
    }
    problems += family_needs(cfg, "nemotron_h", needs, "transformers' NemotronH has no other mode")
    if "E" in cfg.layer_pattern and moe.shared_expert_intermediate_size <= 0:
        problems.append(
            FamilyProblem(
                "model.moe.shared_expert_intermediate_size",
                moe.shared_expert_intermediate_size,
                None,
                "Nemotron-H MoE layers always have shared experts; set it > 0 (HF moe_shared_expert_intermediate_size)",
            )
        )
    return problems


def _mamba(cfg: ModelConfig) -> tuple[RecurrentMixer, ...]:
    mamba = cfg.mamba
    return (
        RecurrentMixer(
            "Mamba-2",
            "mamba",
            mamba.conv_kernel,
            (
                HeadGroup("mamba.num_heads", mamba.num_heads),
                HeadGroup("mamba.n_groups", mamba.n_groups, replicated_when_fewer="B/C groups"),
            ),
        ),
    )


register_hf_family(
    HFFamily(
        "nemotron_h",
        "nemotron_h",
        "NemotronHForCausalLM",
        read_nemotron_h,
        write_nemotron_h,
        key_renames=(("backbone.", "model."),),
        ignore_key=_nemotron_ignores,
    )
)
register_family_rules(
    FamilyRules(
        "nemotron_h",
        problems=nemotron_h_problems,
        layer_pattern_chars="M*E-",
        sections=("mamba",),
        recurrent_mixers=_mamba,
    )
)
