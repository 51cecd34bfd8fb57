"""Hugging Face ``config.json`` <-> ``ModelConfig``, one registered ``HFFamily`` per HF ``model_type``.

A family entry says how to read an HF config dict into a ``ModelConfig`` (architecture only: training knobs such as
``aux_loss_coef`` or ``bias_update_rate`` keep their recipe values), how to write one back (for exports that
transformers can load), how checkpoint keys differ from nemo_ac's (``key_renames``: Nemotron-H's Hub files say
``backbone.`` where transformers 5 and nemo_ac say ``model.``) and which checkpoint keys are not part of the model
(``ignore_key``: multi-token-prediction layers). Another family registers itself with ``register_hf_family``.

HF defaults (transformers 5.18's config classes) fill keys missing from a config.json; settings nemo_ac does not
implement (other rope types, other activations, sparse-step layouts) raise ``NotImplementedError`` naming the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_ac.config.schema import MambaConfig, ModelConfig, MoEConfig

HFDict = dict[str, Any]


@dataclass(frozen=True)
class HFFamily:
    """How one HF ``model_type`` maps onto a nemo_ac family."""

    model_type: str
    family: str
    architecture: str
    read: Callable[[HFDict], ModelConfig]
    write: Callable[[ModelConfig], HFDict]
    # (checkpoint prefix, nemo_ac prefix) pairs, applied to the start of a key.
    key_renames: tuple[tuple[str, str], ...] = ()
    # Checkpoint keys (after renaming) that belong to no nemo_ac parameter and are skipped on load.
    ignore_key: Callable[[str, ModelConfig], bool] = lambda key, cfg: False

    def to_model_key(self, key: str) -> str:
        for hub, ours in self.key_renames:
            if key.startswith(hub):
                return ours + key[len(hub) :]
        return key

    def to_hub_key(self, key: str) -> str:
        for hub, ours in self.key_renames:
            if key.startswith(ours):
                return hub + key[len(ours) :]
        return key


HF_FAMILIES: dict[str, HFFamily] = {}


def register_hf_family(spec: HFFamily) -> None:
    """Adds (or replaces) the mapping for ``spec.model_type``."""
    HF_FAMILIES[spec.model_type] = spec


def hf_family(family: str) -> HFFamily:
    """The registered mapping for a nemo_ac family name."""
    for spec in HF_FAMILIES.values():
        if spec.family == family:
            return spec
    raise NotImplementedError(
        f"no Hugging Face mapping for family {family!r} (registered: {sorted(s.family for s in HF_FAMILIES.values())})"
    )


def load_hf_config_dict(path: str | Path) -> HFDict:
    """``config.json`` of a local model directory (or the file itself)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no config.json (expected a local Hugging Face model directory)")
    return json.loads(file.read_text())


def read_hf_config(path: str | Path) -> ModelConfig:
    """``ModelConfig`` for the model directory at ``path``, dispatched on its ``model_type``."""
    d = load_hf_config_dict(path)
    model_type = d.get("model_type")
    if model_type not in HF_FAMILIES:
        raise NotImplementedError(
            f"{path}: model_type {model_type!r} has no nemo_ac family (supported: {', '.join(sorted(HF_FAMILIES))})"
        )
    return HF_FAMILIES[model_type].read(d)


def hf_config_dict(cfg: ModelConfig) -> HFDict:
    """The HF config dict (``config.json`` content) of ``cfg``'s family."""
    spec = hf_family(cfg.family)
    return {"architectures": [spec.architecture], "model_type": spec.model_type, **spec.write(cfg)}


def _rope(d: HFDict, default_partial: float) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from transformers-5 ``rope_parameters`` or legacy top-level keys."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r}: nemo_ac implements the default rope only")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", default_partial))
    return float(theta), float(partial)


def _require(d: HFDict, key: str, allowed: Any, default: Any) -> None:
    value = d.get(key, default)
    if value != allowed:
        raise NotImplementedError(f"config.json {key}={value!r}: nemo_ac supports {allowed!r} only")


def _first(d: HFDict, keys: tuple[str, ...], default: Any) -> Any:
    """The first of ``keys`` present (NemotronHConfig accepts legacy ``mamba_*`` aliases)."""
    return next((d[k] for k in keys if k in d), default)


def _common(d: HFDict, family: str) -> HFDict:
    heads = d["num_attention_heads"]
    return {
        "family": family,
        "vocab_size": d["vocab_size"],
        "hidden_size": d["hidden_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": d.get("num_key_value_heads") or heads,
        "head_dim": d.get("head_dim") or d["hidden_size"] // heads,
        "intermediate_size": d["intermediate_size"],
        "tie_word_embeddings": d.get("tie_word_embeddings", False),
        "max_position_embeddings": d.get("max_position_embeddings", 4096),
        "init_std": d.get("initializer_range", 0.02),
    }


def _write_common(cfg: ModelConfig) -> HFDict:
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_std,
    }


# --- qwen3_moe -------------------------------------------------------------------------------------------------


def read_qwen3_moe(d: HFDict) -> ModelConfig:
    _require(d, "hidden_act", "silu", "silu")
    mlp_only = sorted(d.get("mlp_only_layers") or [])
    if d.get("decoder_sparse_step", 1) != 1 or mlp_only != list(range(len(mlp_only))):
        raise NotImplementedError("qwen3_moe: only a dense prefix (mlp_only_layers=[0..k-1], decoder_sparse_step=1)")
    theta, partial = _rope(d, 1.0)
    moe = MoEConfig(
        num_experts=_first(d, ("num_experts", "num_local_experts"), 128),  # transformers 5 saves num_local_experts
        num_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_intermediate_size=d.get("moe_intermediate_size", 768),
        norm_topk_prob=d.get("norm_topk_prob", False),
        score_func="softmax",
    )
    return ModelConfig(
        **_common(d, "qwen3_moe"),
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
        **_write_common(cfg),
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


# --- glm4_moe --------------------------------------------------------------------------------------------------


def read_glm4_moe(d: HFDict) -> ModelConfig:
    _require(d, "hidden_act", "silu", "silu")
    theta, partial = _rope(d, 0.5)  # Glm4MoeConfig defaults partial_rotary_factor to 0.5
    inter = d.get("moe_intermediate_size", 1408)
    moe = MoEConfig(
        num_experts=_first(d, ("n_routed_experts", "num_local_experts"), 128),
        num_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=d.get("n_shared_experts", 1) * inter,
        score_func="sigmoid",
        norm_topk_prob=d.get("norm_topk_prob", True),
        n_group=d.get("n_group", 1),
        topk_group=d.get("topk_group", 1),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        score_correction_bias=True,
        # transformers computes GLM's router in fp32 whatever the model dtype.
        router_dtype="float32",
    )
    return ModelConfig(
        **_common(d, "glm4_moe"),
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
        **_write_common(cfg),
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
        "norm_topk_prob": moe.norm_topk_prob,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "num_nextn_predict_layers": 0,
    }


def _glm_ignores(key: str, cfg: ModelConfig) -> bool:
    """GLM checkpoints append their multi-token-prediction layer(s) as model.layers.<num_layers + i>."""
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= cfg.num_layers


# --- nemotron_h ------------------------------------------------------------------------------------------------

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
    _require(d, "mamba_hidden_act", "silu", "silu")
    _require(d, "mlp_hidden_act", "relu2", "relu2")
    pattern = _nemotron_pattern(d)
    mamba = MambaConfig(
        num_heads=d.get("mamba_num_heads", 128),
        head_dim=d.get("mamba_head_dim", 64),
        state_size=d.get("ssm_state_size", 128),
        n_groups=_first(d, ("n_groups", "mamba_n_groups"), 8),
        conv_kernel=_first(d, ("conv_kernel", "mamba_d_conv"), 4),
        chunk_size=_first(d, ("chunk_size", "mamba_chunk_size"), 128),
        expand=_first(d, ("expand", "mamba_expand"), 2),
        conv_bias=_first(d, ("use_conv_bias", "mamba_conv_bias"), True),
        proj_bias=d.get("use_bias", False),
        time_step_min=_first(d, ("time_step_min", "mamba_dt_min"), 0.001),
        time_step_max=_first(d, ("time_step_max", "mamba_dt_max"), 0.1),
        time_step_floor=_first(d, ("time_step_floor", "mamba_dt_init_floor"), 1e-4),
    )
    moe = MoEConfig(
        num_experts=_first(d, ("n_routed_experts", "num_local_experts"), 8),
        num_experts_per_tok=d.get("num_experts_per_tok", 2),
        moe_intermediate_size=d.get("moe_intermediate_size", 7688),
        # transformers: NemotronHMLP(intermediate_size=moe_shared_expert_intermediate_size or intermediate_size).
        shared_expert_intermediate_size=d.get("moe_shared_expert_intermediate_size") or d["intermediate_size"],
        latent_size=d.get("moe_latent_size") or 0,
        score_func="sigmoid",
        norm_topk_prob=d.get("norm_topk_prob", True),
        n_group=d.get("n_group", 1),
        topk_group=d.get("topk_group", 1),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        score_correction_bias=True,
        activation="relu2",
        router_dtype="float32",  # transformers computes the router in fp32
    )
    return ModelConfig(
        **_common(d, "nemotron_h"),
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
        **_write_common(cfg),
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
        "norm_topk_prob": moe.norm_topk_prob,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "num_nextn_predict_layers": 0,
    }


def _nemotron_ignores(key: str, cfg: ModelConfig) -> bool:
    """Nemotron 3 checkpoints keep multi-token-prediction weights under a top-level ``mtp.`` prefix."""
    return key.startswith("mtp.")


register_hf_family(HFFamily("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", read_qwen3_moe, write_qwen3_moe))
register_hf_family(
    HFFamily("glm4_moe", "glm4_moe", "Glm4MoeForCausalLM", read_glm4_moe, write_glm4_moe, ignore_key=_glm_ignores)
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

# Families whose mapping lives in its own module register themselves on import (after everything above exists).
from nemo_ac.models import hf_qwen3_5_moe  # noqa: E402, F401
