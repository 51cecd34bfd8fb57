"""torch.compile of decoder blocks. Not available yet: lands with the compile issue."""

from __future__ import annotations

from torch import nn

from nemo_ac.config.schema import CompileConfig, MoEConfig
from nemo_ac.distributed.activation_checkpointing import ContextFn


def recompute_context_fns(config: CompileConfig) -> list[ContextFn]:
    """Recompute contexts this concern adds to every activation checkpoint (none until compile lands)."""
    return []


def apply_compile(model: nn.Module, *, config: CompileConfig, moe: MoEConfig) -> None:
    if config.enabled:
        raise NotImplementedError("compile.enabled is not available yet; set compile.enabled=false")
