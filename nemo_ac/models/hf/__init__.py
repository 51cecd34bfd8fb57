"""Hugging Face interchange: ``config.json`` <-> ``ModelConfig`` and safetensors checkpoints <-> nemo_ac models.

``registry`` holds ``HFFamily``, the registry keyed by HF ``model_type`` and the helpers the families share; one
module per family (``qwen3_moe``, ``glm4_moe``, ``nemotron_h``, ``qwen3_5_moe``) maps its ``config.json`` both ways
and registers itself on import; ``io`` loads and exports safetensors checkpoints through the registered mapping.
Importing this package imports every family, so the registry is complete. The families import the registry, never
the other way round.
"""

from __future__ import annotations

from nemo_ac.models.hf import glm4_moe, nemotron_h, qwen3_5_moe, qwen3_moe  # noqa: F401 (register the families)
from nemo_ac.models.hf.io import (
    INDEX_FILE,
    HFCheckpointError,
    checkpoint_index,
    export_hf_checkpoint,
    load_hf_checkpoint,
    materialize_and_load,
    model_tensors,
    resolve_pretrained,
)
from nemo_ac.models.hf.registry import (
    HF_FAMILIES,
    HFDict,
    HFFamily,
    hf_config_dict,
    hf_family,
    load_hf_config_dict,
    read_hf_config,
    register_hf_family,
)

__all__ = [
    "HF_FAMILIES",
    "INDEX_FILE",
    "HFCheckpointError",
    "HFDict",
    "HFFamily",
    "checkpoint_index",
    "export_hf_checkpoint",
    "hf_config_dict",
    "hf_family",
    "load_hf_checkpoint",
    "load_hf_config_dict",
    "materialize_and_load",
    "model_tensors",
    "read_hf_config",
    "register_hf_family",
    "resolve_pretrained",
]
