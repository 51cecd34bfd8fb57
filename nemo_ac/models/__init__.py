"""Model families. ``build_model`` constructs on the meta device; weights come later from
``nemo_ac.models.init.materialize_and_init`` (random) or a checkpoint loader, after parallelization."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models.glm4_moe import build_glm4_moe
from nemo_ac.models.interfaces import AttentionInputs, ModelOutput, RouterStats
from nemo_ac.models.nemotron_h import build_nemotron_h
from nemo_ac.models.qwen3_5_moe import build_qwen3_5_moe
from nemo_ac.models.qwen3_moe import build_qwen3_moe

__all__ = [
    "MODEL_BUILDERS",
    "AttentionInputs",
    "ModelOutput",
    "RouterStats",
    "build_model",
    "model_dtype",
]

MODEL_BUILDERS: dict[str, Callable[[ModelConfig], nn.Module]] = {
    "qwen3_moe": build_qwen3_moe,
    "glm4_moe": build_glm4_moe,
    "nemotron_h": build_nemotron_h,
    "qwen3_5_moe": build_qwen3_5_moe,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (the schema's ``DTypeName`` values)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def build_model(
    cfg: ModelConfig,
    *,
    experts_impl: str | None = None,
    router_gemm: str | None = None,
    device: torch.device | str = "meta",
) -> nn.Module:
    """Builds the family's causal LM on ``device`` (meta by default: no memory, no init cost). ``experts_impl``:
    the experts kernel the plan chose (``KernelPlan.experts``), built in place of ``cfg.moe.experts_impl`` (the
    recipe keeps what the user wrote, ``auto`` included)."""
    builder = MODEL_BUILDERS.get(cfg.family)
    if builder is None:
        raise NotImplementedError(
            f"model family {cfg.family!r} is not implemented yet (implemented: {', '.join(sorted(MODEL_BUILDERS))})"
        )
    if experts_impl is not None:
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, experts_impl=experts_impl))
    if router_gemm is not None and router_gemm != "param":
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router_gemm=router_gemm))
    with torch.device(device):
        return builder(cfg)
