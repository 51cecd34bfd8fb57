"""Wrapping blocks in activation checkpoints as the plan says (modes none, full and selective).

Blocks are wrapped with torch's non-reentrant ``checkpoint_wrapper`` (DCP and HF export strip its
``_checkpoint_wrapped_module`` prefix, so checkpoint keys keep the HF names). Each wrapper's ``context_fn`` composes
the recompute contexts the block's plan names: the SAC modes (selective), the forward-thread compile context
(AC(compile(block)) blocks, ``workarounds.forward_thread_compile_config``) and routing replay (MoE blocks,
``models.layers.routing_replay``). Where torch's ``checkpoint`` takes ``respect_saved_tensors_hooks`` (2.14 on),
every call passes nemo_ac's choice explicitly (``contexts.SAC_CACHE_THROUGH_SAVED_TENSORS_HOOKS``): left at None,
torch warns on every SAC region under a saved-tensor hook and its next release raises.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from nemo_ac.distributed.activation_checkpointing.contexts import (
    SAC_CACHE_THROUGH_SAVED_TENSORS_HOOKS,
    ContextFn,
    compose_context_fns,
    sac_region_context_fn,
    selective_policy_factory,
)
from nemo_ac.distributed.blocks import decoder_layers, vision_blocks
from nemo_ac.distributed.plan import BlockPlan, ParallelPlan, RecomputeContext
from nemo_ac.models.layers.routing_replay import routing_replay_context
from nemo_ac.workarounds.forward_thread_compile_config import forward_thread_compile_context
from nemo_ac.workarounds.fsdp_hooks_in_sac import install_fsdp_hooks_outside_sac
from nemo_ac.workarounds.profiler_ops_in_sac import ensure_profiler_ops_sac_ignored
from nemo_ac.workarounds.sac_mode_passthrough import checkpoint_takes_saved_tensors_hooks_choice


def checkpoint_kwargs() -> dict[str, object]:
    """What every nemo_ac checkpoint call passes to ``torch.utils.checkpoint.checkpoint``."""
    kwargs: dict[str, object] = {"use_reentrant": False}
    if checkpoint_takes_saved_tensors_hooks_choice():
        kwargs["respect_saved_tensors_hooks"] = SAC_CACHE_THROUGH_SAVED_TENSORS_HOOKS
    return kwargs


def wrap_block(block: nn.Module, *, context_fns: Sequence[ContextFn]) -> nn.Module:
    kwargs = {}
    if context_fns:
        kwargs["context_fn"] = compose_context_fns(context_fns)
    return checkpoint_wrapper(
        block,
        checkpoint_impl=CheckpointImpl.NO_REENTRANT,
        checkpoint_fn=functools.partial(checkpoint, **checkpoint_kwargs()),
        **kwargs,
    )


def _sac_modes(block_plan: BlockPlan, plan: ParallelPlan) -> ContextFn:
    # The policy reads the plan's decision (``SelectiveACPlan``) itself. The profiler-op ignore is apply_ac's, as the
    # plan's workarounds say; the region's modes are the same either way.
    policy = selective_policy_factory(plan.selective, region=block_plan.path)
    return sac_region_context_fn(policy, region=block_plan.path)


# RecomputeContext -> its context function for one block (every member has a row: a new word needs its maker).
_CONTEXT_MAKERS: dict[RecomputeContext, Callable[[BlockPlan, ParallelPlan], ContextFn]] = {
    RecomputeContext.SAC_MODES: _sac_modes,
    RecomputeContext.FORWARD_THREAD_COMPILE: lambda block_plan, plan: forward_thread_compile_context,
    RecomputeContext.ROUTING_REPLAY: lambda block_plan, plan: routing_replay_context,
}


def block_context_fns(block_plan: BlockPlan, *, plan: ParallelPlan) -> list[ContextFn]:
    """The recompute contexts of one block's checkpoint, in the plan's order; ``block_plan.path`` names the SAC
    region in desync errors."""
    return [_CONTEXT_MAKERS[context](block_plan, plan) for context in block_plan.recompute_contexts]


def apply_ac(model: nn.Module, *, plan: ParallelPlan) -> None:
    """Wrap every block the plan checkpoints (decoder and vision blocks), in place; install the profiler-op ignore
    where the plan switches it on (``workarounds.profiler_ops_in_sac``, process-wide and idempotent)."""
    if "profiler_ops_in_sac" in plan.workarounds:
        ensure_profiler_ops_sac_ignored()
    for blocks, plans in ((decoder_layers(model), plan.decoder_blocks()), (vision_blocks(model), plan.vision_blocks())):
        if blocks is None:
            continue
        if len(plans) != len(blocks):
            raise ValueError(f"the plan has {len(plans)} blocks for {len(blocks)} in the model")
        for index, block_plan in enumerate(plans):
            if block_plan.checkpointed:
                blocks[index] = wrap_block(blocks[index], context_fns=block_context_fns(block_plan, plan=plan))


def install_sac_fsdp_workarounds(model: nn.Module, *, plan: ParallelPlan) -> int:
    """After fully_shard: run FSDP2's forward hooks outside the SAC modes (``workarounds.fsdp_hooks_in_sac``).
    Returns the number of FSDP units bracketed (0 unless the plan switches the workaround on)."""
    if "fsdp_hooks_in_sac" not in plan.workarounds:
        return 0
    return install_fsdp_hooks_outside_sac(model)
