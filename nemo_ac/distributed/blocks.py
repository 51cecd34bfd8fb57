"""Where the parallelizer finds a model's blocks, their sequence mixers and their routed MoE.

Only through the contract in ``nemo_ac.models.interfaces`` (``ParallelizableModel``, ``DecoderBlock``,
``SequenceMixer``, ``RoutedMoE``): no attribute-name probing. A model that does not implement it fails here with
the missing piece named, before anything is applied.
"""

from __future__ import annotations

from torch import nn

from nemo_ac.models.interfaces import DecoderBlock, ParallelizableModel, RoutedMoE, SequenceMixer


def _parallelizable(model: nn.Module) -> ParallelizableModel:
    if not isinstance(model, ParallelizableModel):
        raise TypeError(
            f"{type(model).__name__} does not implement nemo_ac.models.interfaces.ParallelizableModel "
            "(decoder_blocks_path, decoder_blocks(), vision_blocks()); nemo_ac parallelizes models that do"
        )
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's block list (``model.model.layers`` or ``model.model.language_model.layers``)."""
    return _parallelizable(model).decoder_blocks()


def decoder_layers_path(model: nn.Module) -> str:
    """Dotted path of the decoder's block list, for region names in errors and the printed plan."""
    return _parallelizable(model).decoder_blocks_path


def vision_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The vision tower's blocks (``model.model.visual.blocks``), or None for text-only models.

    They are FSDP units and activation-checkpointed like decoder blocks, but never compiled: the tower loops over
    images with Python ints from ``image_grid_thw`` (a recompile per image layout) and runs once per micro batch
    on the full sequence, before context-parallel sharding.
    """
    blocks = _parallelizable(model).vision_blocks()
    return blocks if blocks is not None and len(blocks) > 0 else None


def unwrap_block(block: nn.Module) -> nn.Module:
    """The block under an activation-checkpoint wrapper (torch's ``_checkpoint_wrapped_module``)."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def routed_moe(block: nn.Module) -> RoutedMoE | None:
    """The block's routed MoE (None: a dense block), through ``DecoderBlock.routed_moe``."""
    inner = unwrap_block(block)
    if not isinstance(inner, DecoderBlock):
        raise TypeError(
            f"{type(inner).__name__} does not implement nemo_ac.models.interfaces.DecoderBlock (routed_moe())"
        )
    return inner.routed_moe()


def sequence_mixers(block: nn.Module) -> list[SequenceMixer]:
    """Every ``SequenceMixer`` in the block: what context parallel must let see more than its own tokens."""
    return [module for module in unwrap_block(block).modules() if isinstance(module, SequenceMixer)]
