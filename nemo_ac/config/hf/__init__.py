"""Hugging Face ``config.json`` <-> ``ModelConfig``: the registry and one module per family, which also declares the
family's recipe rules (``family_rules``: ``nemo_ac.config.families``).

Pure (no torch): ``config.load`` reads a ``model.pretrained`` checkpoint's ``config.json`` through these mappings
before any process group exists, so they live under ``config/`` (which may import neither ``models/`` nor torch);
``nemo_ac.trainer.checkpoint.hf_safetensors`` uses the same registry for the safetensors key mapping. Importing this
package imports every family, so the registry is complete; the families import the registry, never the other way round.
"""

from __future__ import annotations

from nemo_ac.config.hf import glm4_moe, nemotron_h, qwen3_5_moe, qwen3_moe  # noqa: F401 (register the families)
from nemo_ac.config.hf.registry import (
    FAMILY_RULES,
    HF_FAMILIES,
    HFDict,
    HFFamily,
    family_rules,
    hf_config_dict,
    hf_family,
    load_hf_config_dict,
    read_hf_config,
    read_hf_config_dict,
    register_hf_family,
)

__all__ = [
    "FAMILY_RULES",
    "HF_FAMILIES",
    "HFDict",
    "HFFamily",
    "family_rules",
    "hf_config_dict",
    "hf_family",
    "load_hf_config_dict",
    "read_hf_config",
    "read_hf_config_dict",
    "register_hf_family",
]
