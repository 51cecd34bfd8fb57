"""Where the parallelizer finds transformer blocks and their nested FSDP units.

One source of truth used by AC, compile and FSDP: a block "holds a nested FSDP unit" when its experts or its fp32
router are fully_shard-ed separately inside it. That is the layout whose FSDP hooks run inside a checkpointed
region (the torch 2.13 SAC desync) and the layout ``compile.layout: auto`` compiles as AC(compile(block)).
"""

from __future__ import annotations

from torch import nn

from nemo_ac.config.schema import MoEConfig

# Where HF-style models keep their decoder blocks, relative to the causal-LM wrapper: text-only families
# (``model.layers``) and vision-language ones, whose text decoder sits beside the vision tower
# (``model.language_model.layers``, Qwen3.5/3.6).
DECODER_LAYER_PATHS = ("model.layers", "model.language_model.layers")
# The vision tower's block list (Qwen3.5/3.6: ``model.visual.blocks``); absent in text-only models.
VISION_BLOCK_PATH = "model.visual.blocks"


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    module: nn.Module | None = model
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def decoder_layers_path(model: nn.Module) -> str:
    """Dotted path of the decoder's block list (``model.layers`` or ``model.language_model.layers``)."""
    for path in DECODER_LAYER_PATHS:
        if isinstance(_module_at(model, path), nn.ModuleList):
            return path
    raise TypeError(
        f"{type(model).__name__} has no decoder block list at any of {list(DECODER_LAYER_PATHS)}; nemo_ac "
        "parallelizes HF-style models"
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's block list (HF layout: ``model.model.layers``, or ``model.model.language_model.layers``)."""
    return _module_at(model, decoder_layers_path(model))  # type: ignore[return-value]


def vision_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The vision tower's blocks (``model.model.visual.blocks``), or None for text-only models.

    They are FSDP units and activation-checkpointed like decoder blocks, but never compiled: the tower loops over
    images with Python ints from ``image_grid_thw`` (a recompile per image layout) and runs once per micro batch
    on the full sequence, before context-parallel sharding.
    """
    blocks = _module_at(model, VISION_BLOCK_PATH)
    return blocks if isinstance(blocks, nn.ModuleList) and len(blocks) > 0 else None


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
