"""Hugging Face ``config.json`` <-> ``ModelConfig`` for Qwen3.5 / Qwen3.6 MoE (``model_type: qwen3_5_moe``).

The Hub config nests the text decoder under ``text_config`` and the vision tower under ``vision_config``; token
ids of the image placeholder and the vision start / end markers sit at the top level. Checkpoint keys need no
renaming (``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``; routed experts per expert, which
``nemo_ac.trainer.checkpoint.hf_safetensors`` groups). The multi-token-prediction head (``mtp.*``,
``text_config.mtp_num_hidden_layers``) is not part of the model and is skipped on load.

Fixed by the architecture (transformers' ``Qwen3_5Moe*`` has no switch for them): softmax router with normalized
top-k, a sigmoid-gated shared expert, gated attention with q/k norms, every decoder layer MoE. A config that asks for
anything else is rejected by ``write`` rather than exported as a model transformers would build differently.
"""

from __future__ import annotations

from typing import Any

from nemo_ac.config.families import FamilyRules, HeadGroup, RecurrentMixer
from nemo_ac.config.hf.registry import HFDict, HFFamily, read_rope, register_family_rules, register_hf_family, require
from nemo_ac.config.schema import LinearAttentionConfig, ModelConfig, MoEConfig, VisionConfig

_LAYER_TYPES = {"linear_attention": "L", "full_attention": "A"}
# transformers' Qwen3_5MoeTextConfig: no layer_types means every 4th layer is full attention.
_DEFAULT_FULL_ATTENTION_INTERVAL = 4


def _layer_pattern(text: HFDict) -> str:
    types = text.get("layer_types")
    if not types:
        interval = text.get("full_attention_interval", _DEFAULT_FULL_ATTENTION_INTERVAL)
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(text["num_hidden_layers"])
        ]
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"qwen3_5_moe layer types {unknown} are not implemented")
    return "".join(_LAYER_TYPES[t] for t in types)


def _vision(d: HFDict) -> VisionConfig:
    v: HFDict = d.get("vision_config") or {}
    require(v, "hidden_act", "gelu_pytorch_tanh", "gelu_pytorch_tanh")
    if v.get("deepstack_visual_indexes"):
        raise NotImplementedError("qwen3_5_moe: deepstack_visual_indexes are not implemented (Qwen3.5/3.6 use none)")
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        depth=v.get("depth", 27),
        hidden_size=v.get("hidden_size", 1152),
        num_heads=v.get("num_heads", 16),
        intermediate_size=v.get("intermediate_size", 4304),
        patch_size=v.get("patch_size", 16),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        in_channels=v.get("in_channels", 3),
        num_position_embeddings=v.get("num_position_embeddings", 2304),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_token_id=d.get("image_token_id", 248056),
        vision_start_token_id=d.get("vision_start_token_id", 248053),
        vision_end_token_id=d.get("vision_end_token_id", 248054),
    )


def read_qwen3_5_moe(d: HFDict) -> ModelConfig:
    """``ModelConfig`` of a Qwen3.5/3.6 MoE ``config.json`` (the VL layout; a bare text config reads too)."""
    text: HFDict = d.get("text_config") or d
    require(text, "hidden_act", "silu", "silu")
    theta, partial = read_rope(text, 0.25)  # Qwen3_5MoeTextConfig's default partial_rotary_factor
    rope = text.get("rope_parameters") or {}
    if rope.get("mrope_interleaved", True) is not True:
        raise NotImplementedError("qwen3_5_moe: only interleaved M-RoPE (rope_parameters.mrope_interleaved=true)")
    heads = text["num_attention_heads"]
    pattern = _layer_pattern(text)
    moe = MoEConfig(
        num_experts=text.get("num_experts", 256),
        num_experts_per_tok=text.get("num_experts_per_tok", 8),
        moe_intermediate_size=text.get("moe_intermediate_size", 512),
        shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 512),
        shared_expert_gate=True,
        score_func="softmax",
        norm_topk_prob=True,
    )
    linear = LinearAttentionConfig(
        num_key_heads=text.get("linear_num_key_heads", 16),
        num_value_heads=text.get("linear_num_value_heads", 32),
        key_head_dim=text.get("linear_key_head_dim", 128),
        value_head_dim=text.get("linear_value_head_dim", 128),
        conv_kernel=text.get("linear_conv_kernel_dim", 4),
    )
    return ModelConfig(
        family="qwen3_5_moe",
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        num_layers=len(pattern),
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        rope_theta=theta,
        partial_rotary_factor=partial,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        attention_bias=text.get("attention_bias", False),
        qk_norm=True,
        attn_output_gate=True,
        tie_word_embeddings=d.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        init_std=text.get("initializer_range", 0.02),
        layer_pattern=pattern,
        mrope_section=list(rope.get("mrope_section") or []),
        moe=moe,
        linear_attention=linear,
        vision=_vision(d) if "vision_config" in d else VisionConfig(),
    )


# Settings transformers' Qwen3_5Moe has no switch for, and the value it always uses.
_FIXED_BY_ARCHITECTURE: dict[str, Any] = {
    "moe.score_func": "softmax",
    "moe.norm_topk_prob": True,
    "moe.shared_expert_gate": True,
    "attn_output_gate": True,
    "qk_norm": True,
    "first_k_dense_replace": 0,
}


def _setting(cfg: ModelConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def write_qwen3_5_moe(cfg: ModelConfig) -> HFDict:
    """The Hub config dict (what transformers' ``Qwen3_5MoeConfig`` reads) of ``cfg``."""
    moe, linear, v = cfg.moe, cfg.linear_attention, cfg.vision
    wrong = [
        f"model.{key}={_setting(cfg, key)!r} (needs {want!r})"
        for key, want in _FIXED_BY_ARCHITECTURE.items()
        if _setting(cfg, key) != want
    ]
    if wrong:
        raise ValueError(f"qwen3_5_moe: transformers' Qwen3_5Moe cannot express {', '.join(wrong)}")
    types = {"L": "linear_attention", "A": "full_attention"}
    pattern = cfg.layer_pattern or "".join(
        "A" if (i + 1) % _DEFAULT_FULL_ATTENTION_INTERVAL == 0 else "L" for i in range(cfg.num_layers)
    )
    text = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": cfg.attention_bias,
        "attn_output_gate": True,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
            "mrope_section": list(cfg.mrope_section),
            "mrope_interleaved": True,
        },
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "layer_types": [types[c] for c in pattern],
        "linear_conv_kernel_dim": linear.conv_kernel,
        "linear_key_head_dim": linear.key_head_dim,
        "linear_value_head_dim": linear.value_head_dim,
        "linear_num_key_heads": linear.num_key_heads,
        "linear_num_value_heads": linear.num_value_heads,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "mtp_num_hidden_layers": 0,
    }
    vision = {
        "model_type": "qwen3_5_moe_vision",
        "depth": v.depth,
        "hidden_size": v.hidden_size,
        "hidden_act": "gelu_pytorch_tanh",
        "num_heads": v.num_heads,
        "intermediate_size": v.intermediate_size,
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "spatial_merge_size": v.spatial_merge_size,
        "in_channels": v.in_channels,
        "num_position_embeddings": v.num_position_embeddings,
        "out_hidden_size": cfg.hidden_size,
        "initializer_range": cfg.init_std,
        "deepstack_visual_indexes": [],
    }
    return {
        "text_config": text,
        "vision_config": vision,
        "image_token_id": v.image_token_id,
        "vision_start_token_id": v.vision_start_token_id,
        "vision_end_token_id": v.vision_end_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def _mtp_key(key: str, cfg: ModelConfig) -> bool:
    """The multi-token-prediction head ships under a top-level ``mtp.`` prefix (Qwen3.5/3.6 Hub checkpoints)."""
    return key.startswith("mtp.")


def _gated_deltanet(cfg: ModelConfig) -> tuple[RecurrentMixer, ...]:
    linear = cfg.linear_attention
    heads = (
        HeadGroup("linear_attention.num_key_heads", linear.num_key_heads),
        HeadGroup("linear_attention.num_value_heads", linear.num_value_heads),
    )
    return (RecurrentMixer("Gated DeltaNet", "linear_attention", linear.conv_kernel, heads),)


register_hf_family(
    HFFamily(
        "qwen3_5_moe",
        "qwen3_5_moe",
        "Qwen3_5MoeForConditionalGeneration",
        read_qwen3_5_moe,
        write_qwen3_5_moe,
        ignore_key=_mtp_key,
    )
)
register_family_rules(
    FamilyRules(
        "qwen3_5_moe",
        layer_pattern_chars="LA",
        sections=("linear_attention", "vision"),
        recurrent_mixers=_gated_deltanet,
        vision=True,
    )
)
