"""Hugging Face ``config.json`` <-> ``ModelConfig``, one registered ``HFFamily`` per HF ``model_type``.

A family entry says how to read an HF config dict into a ``ModelConfig`` (architecture only: training knobs such as
``aux_loss_coef`` or ``bias_update_rate`` keep their recipe values), how to write one back (for exports that
transformers can load), how checkpoint keys differ from nemo_ac's (``key_renames``: Nemotron-H's Hub files say
``backbone.`` where transformers 5 and nemo_ac say ``model.``) and which checkpoint keys are not part of the model
(``ignore_key``: multi-token-prediction layers). Another family registers itself with ``register_hf_family``, and
declares its recipe rules (``nemo_ac.config.families.FamilyRules``) with ``register_family_rules``.

This module holds the registry, the ``config.json`` dispatch and the helpers the families share; each family's
mapping lives in its own module of ``nemo_ac.config.hf`` and registers itself on import (``nemo_ac.config.hf``
imports them all). This module imports no family, and nothing here imports torch.

HF defaults (transformers 5.18's config classes) fill keys missing from a config.json; settings nemo_ac does not
implement (other rope types, other activations, sparse-step layouts) raise ``NotImplementedError`` naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_ac.config.families import FamilyRules
from nemo_ac.config.schema import ModelConfig, MoEConfig

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


FAMILY_RULES: dict[str, FamilyRules] = {}


def register_family_rules(rules: FamilyRules) -> None:
    """Adds (or replaces) what ``rules.family`` declares to the recipe rules (``nemo_ac.config.families``)."""
    FAMILY_RULES[rules.family] = rules


def family_rules(family: str) -> FamilyRules:
    """What a family declares to the recipe rules; a family that declares nothing gets the defaults (a plain
    decoder: no layer pattern, no sections of its own, no recurrent mixers, no vision tower)."""
    return FAMILY_RULES.get(family, FamilyRules(family))


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
    return read_hf_config_dict(load_hf_config_dict(path), source=str(path))


def read_hf_config_dict(d: HFDict, *, source: str = "config.json") -> ModelConfig:
    """``ModelConfig`` of a ``config.json`` dict, dispatched on its ``model_type``."""
    model_type = d.get("model_type")
    if model_type not in HF_FAMILIES:
        raise NotImplementedError(
            f"{source}: model_type {model_type!r} has no nemo_ac family (supported: {', '.join(sorted(HF_FAMILIES))})"
        )
    return HF_FAMILIES[model_type].read(d)


def hf_config_dict(cfg: ModelConfig) -> HFDict:
    """The HF config dict (``config.json`` content) of ``cfg``'s family."""
    spec = hf_family(cfg.family)
    return {"architectures": [spec.architecture], "model_type": spec.model_type, **spec.write(cfg)}


def read_rope(d: HFDict, default_partial: float) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from transformers-5 ``rope_parameters`` or legacy top-level keys."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r}: nemo_ac implements the default rope only")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", default_partial))
    return float(theta), float(partial)


def require(d: HFDict, key: str, allowed: Any, default: Any) -> None:
    """Raises ``NotImplementedError`` unless ``d[key]`` (``default`` when absent) is ``allowed``."""
    value = d.get(key, default)
    if value != allowed:
        raise NotImplementedError(f"config.json {key}={value!r}: nemo_ac supports {allowed!r} only")


def first_present(d: HFDict, keys: tuple[str, ...], default: Any) -> Any:
    """The first of ``keys`` present (NemotronHConfig accepts legacy ``mamba_*`` aliases)."""
    return next((d[k] for k in keys if k in d), default)


def read_common(d: HFDict, family: str) -> HFDict:
    """``ModelConfig`` keyword arguments every flat (non-nested) family reads the same way."""
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


def read_grouped_sigmoid_routing(d: HFDict) -> HFDict:
    """``MoEConfig`` keyword arguments of DeepSeek-V3-style routing (sigmoid scores, a score-correction bias, group
    top-k, a routed scaling factor), which GLM-4.5 and Nemotron 3 read the same way. transformers computes these
    routers in fp32 whatever the model dtype, hence ``router_dtype``."""
    return {
        "score_func": "sigmoid",
        "norm_topk_prob": d.get("norm_topk_prob", True),
        "n_group": d.get("n_group", 1),
        "topk_group": d.get("topk_group", 1),
        "routed_scaling_factor": float(d.get("routed_scaling_factor", 1.0)),
        "score_correction_bias": True,
        "router_dtype": "float32",
    }


def write_grouped_sigmoid_routing(moe: MoEConfig) -> HFDict:
    """The inverse of ``read_grouped_sigmoid_routing``: the routing keys of ``config.json``."""
    return {
        "norm_topk_prob": moe.norm_topk_prob,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor,
    }


def write_common(cfg: ModelConfig) -> HFDict:
    """The inverse of ``read_common``: the ``config.json`` keys every flat family writes the same way."""
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
