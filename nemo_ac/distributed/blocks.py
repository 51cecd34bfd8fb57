"""Where the parallelizer finds transformer blocks and their nested FSDP units.

One source of truth used by AC, compile and FSDP: a block "holds a nested FSDP unit" when its experts or its fp32
router are fully_shard-ed separately inside it. That is the layout whose FSDP hooks run inside a checkpointed
region (the torch 2.13 SAC desync) and the layout ``compile.layout: auto`` compiles as AC(compile(block)).
"""

from __future__ import annotations

from torch import nn

from nemo_ac.config.schema import MoEConfig


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's block list (HF layout: ``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList; nemo_ac parallelizes HF-style models")
    return layers


def unwrap_block(block: nn.Module) -> nn.Module:
    """The block under an activation-checkpoint wrapper (torch's ``_checkpoint_wrapped_module``)."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def nested_fsdp_units(block: nn.Module, *, moe: MoEConfig) -> list[nn.Module]:
    """Submodules of ``block`` that get their own fully_shard: experts, and the router when kept in fp32."""
    inner = unwrap_block(block)
    mlp = getattr(inner, "mlp", None)
    if mlp is None or not getattr(inner, "is_moe", False):
        return []
    units: list[nn.Module] = []
    if moe.router_dtype == "float32":
        units.append(mlp.gate)
    if moe.separate_fsdp_unit:
        units.append(mlp.experts)
    return units


def holds_nested_fsdp_unit(block: nn.Module, *, moe: MoEConfig) -> bool:
    return bool(nested_fsdp_units(block, moe=moe))
