"""Hugging Face interchange: ``config.json`` <-> ``ModelConfig`` and safetensors checkpoints <-> nemo_ac models.

The ``config.json`` side is pure and lives in ``nemo_ac.config.hf`` (the registry keyed by HF ``model_type`` and one
module per family: ``qwen3_moe``, ``glm4_moe``, ``nemotron_h``, ``qwen3_5_moe``), because recipes read a pretrained
checkpoint's ``config.json`` before any process group and ``config/`` may not import ``models/``. ``io`` loads and
exports safetensors checkpoints through that registered mapping; this package re-exports both.
"""

from __future__ import annotations

from nemo_ac.config.hf import (
    HF_FAMILIES,
    HFDict,
    HFFamily,
    hf_config_dict,
    hf_family,
    load_hf_config_dict,
    read_hf_config,
    read_hf_config_dict,
    register_hf_family,
)
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
    "read_hf_config_dict",
    "register_hf_family",
    "resolve_pretrained",
]
