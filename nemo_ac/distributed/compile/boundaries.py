"""Token dims dynamic across the eager boundaries inside a compiled block: the calls of its nested FSDP units.

Under AC(compile(block)) a block with nested FSDP units (the experts, the fp32 router) compiles in pieces: Dynamo
graph-breaks at each unit's FSDP2 hooks, the unit's call runs eagerly, its forward compiles as a frame of its own,
and the block resumes in a resume frame. Sizes that vary per step (expert-parallel received rows; every token dim
when row lengths vary) reach those frames from eager code, where no dynamic dim travels, so each of them would be
compiled static and recompiled at the first change (``tensor '___stack0' size mismatch at index 0``). A forward
pre-hook and a forward hook on every nested unit mark the token dims of what goes in and what comes out
(``workarounds.dynamic_per_batch_ints.mark_token_dims``), so those frames compile them dynamic the first time. What a resume frame keeps as its own locals (expert parallelism's
dispatch context) is declared by name in ``workarounds.dynamic_per_batch_ints.DYNAMIC_INT_ARGS``.

The hooks are ``torch.compiler.disable``-d, so Dynamo never compiles or traces the marking, and they go only on a
unit that ``fully_shard`` made an FSDP2 unit: its call is already a graph break (FSDP2's hooks are disabled the same way), so they add none. That is known only after
``apply_fsdp``, so ``apply_compile`` hands ``mark_unit_boundaries`` to the block's compiled forward, which runs it
before its first call. Registered then, they run after FSDP2's pre-forward hook and after its post-forward hook
(the outputs as the block gets them, a mixed-precision ``output_dtype`` cast included).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from nemo_ac.distributed.blocks import routed_moe
from nemo_ac.distributed.plan import BlockPlan
from nemo_ac.distributed.plan.vocabulary import NestedUnit
from nemo_ac.workarounds.dynamic_per_batch_ints import mark_token_dims


@torch.compiler.disable
def _mark_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    mark_token_dims((args, kwargs))


@torch.compiler.disable
def _mark_outputs(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    mark_token_dims(output)


def nested_unit_modules(block: nn.Module, block_plan: BlockPlan) -> list[nn.Module]:
    """The modules of ``block`` that the plan shards as their own FSDP units (router, experts), in plan order."""
    moe = routed_moe(block) if block_plan.nested_units else None
    if moe is None:
        return []
    pick = {NestedUnit.ROUTER: moe.router_module, NestedUnit.EXPERTS: moe.experts_module}
    return [pick[NestedUnit(unit)]() for unit in block_plan.nested_units]


def mark_token_dims_at(unit: nn.Module) -> list[RemovableHandle]:
    """Hook ``unit`` (called eagerly between compiled frames) so the token dims of its inputs and outputs compile
    dynamic in the frames that take them; the two hook handles."""
    return [unit.register_forward_pre_hook(_mark_inputs, with_kwargs=True), unit.register_forward_hook(_mark_outputs)]


def mark_unit_boundaries(block: nn.Module, block_plan: BlockPlan) -> list[RemovableHandle]:
    """``mark_token_dims_at`` every nested unit of ``block`` that is an FSDP2 unit (none before ``fully_shard``, or
    where the plan's units were not sharded); the handles."""
    units = [unit for unit in nested_unit_modules(block, block_plan) if isinstance(unit, FSDPModule)]
    return [handle for unit in units for handle in mark_token_dims_at(unit)]
