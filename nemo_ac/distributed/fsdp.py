"""FSDP2 (``fully_shard``) of blocks, nested expert / fp32-router units, the root, and explicit prefetch.

Gradients are reduced as sums (divide factor 1): the trainer normalizes the loss by the global number of label
tokens, so the sum over ranks is the token-weighted mean no matter how dense (dp_shard x cp) and expert
(ep_shard) meshes differ in size.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from nemo_ac.distributed.blocks import decoder_layers, routed_moe, unwrap_block, vision_blocks
from nemo_ac.distributed.plan import FSDPUnit, ParallelPlan

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _shard_placement_for_experts(mesh: DeviceMesh):
    """Shard experts on dim 0 (experts) unless there are more shards than local experts, then dim 1.

    Under expert parallel the weights arrive as DTensors ``Shard(0)`` on the ep mesh, so "local experts" are this
    rank's E/ep; FSDP shards them over the last dim of ``mesh`` (``ep_shard``; HSDP replicates over the first).
    Dim 0 with fewer experts than shards would leave some ranks with empty shards and uneven padding; dim 1
    (2*I or H rows) divides evenly in every recipe.
    """
    shards = mesh.size(mesh.ndim - 1)

    def placement(param: nn.Parameter):
        from torch.distributed.tensor import Shard

        local_experts = param.to_local().shape[0] if hasattr(param, "to_local") else param.shape[0]
        return Shard(1) if shards > local_experts else Shard(0)

    return placement


def cast_masters(model: nn.Module, dtype: torch.dtype) -> int:
    """Casts the model's floating parameters (on meta, before ``fully_shard``) to ``dtype``, the dtype FSDP then
    shards, the optimizer updates and the gradients are reduced into (``train.master_dtype``). Parameters of a module
    that says ``keep_fp32`` (an fp32 router: its own unit computes in fp32) keep their dtype; buffers (RoPE tables,
    router correction biases) are left alone; a parameter shared by two modules (tied embeddings) stays one.
    Returns how many parameters were cast."""
    kept = {
        id(param) for module in model.modules() if getattr(module, "keep_fp32", False) for param in module.parameters()
    }
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) in kept or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in cast:
                cast[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            setattr(module, name, cast[id(param)])
    return len(cast)


def fp32_router_policy() -> MixedPrecisionPolicy:
    """An fp32 router's unit: fp32 weights gathered and gradients reduced, its input left as it comes. The router
    casts what its GEMM needs (``models.layers.router``), and its bf16x3 GEMM takes bf16 hidden states as they are:
    FSDP's input cast (``cast_forward_inputs``) made them an fp32 copy ([tokens, hidden] per MoE block) and hid from
    the router that they were bf16, so an fp32 GEMM ran on CUDA cores (0.28 s of Nemotron Super's step at
    Automodel's shape, by the dry run)."""
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(
    model: nn.Module, *, plan: ParallelPlan, dense_mesh: DeviceMesh, expert_mesh: DeviceMesh
) -> list[FSDPModule]:
    """fully_shard nested units, then each block, then the root, as the plan says. Returns every FSDP module, root
    last.

    A block plan's ``fsdp_unit`` says whether the block under its AC wrapper (``block``: AC(fully_shard(block)), the
    block's own hooks run inside the checkpoint) or the wrapper (``wrapper``: fully_shard(AC(block)), torchtitan's
    layout) is sharded; ``nested_units`` which submodules get their own unit first (the router in fp32 on the dense
    mesh, the experts on the expert mesh).
    """
    fsdp = plan.fsdp
    if fsdp.master_dtype != "float32":
        cast_masters(model, torch_dtype(fsdp.master_dtype))
    # train.optimizer_offload: full. Every unit, the root included: a unit left on the device would keep its fp32
    # shard, gradient and states there, and the optimizer would step tensors on two devices.
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=fsdp.pin_host_memory) if fsdp.parameters_on_host else OffloadPolicy()
    )
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(fsdp.param_dtype), reduce_dtype=torch_dtype(fsdp.reduce_dtype))
    fp32 = fp32_router_policy()
    units: list[FSDPModule] = []
    block_units: list[FSDPModule] = []
    nested_by_block: list[list[FSDPModule]] = []
    # Vision blocks (VL families) are units of their own, like decoder blocks: the tower's weights are gathered
    # one block at a time, and a frozen tower's units have no gradients, so FSDP reduces nothing for them.
    for block, block_plan in zip(vision_blocks(model) or [], plan.vision_blocks()):
        target = unwrap_block(block) if block_plan.fsdp_unit is FSDPUnit.BLOCK else block
        units.append(
            fully_shard(
                target,
                mesh=dense_mesh,
                mp_policy=mp,
                reshard_after_forward=fsdp.reshard_after_forward,
                offload_policy=offload,
            )
        )
    for block, block_plan in zip(decoder_layers(model), plan.decoder_blocks()):
        nested: list[FSDPModule] = []
        moe = routed_moe(block) if block_plan.nested_units else None
        for unit_name in block_plan.nested_units:
            if unit_name == "router":
                unit = fully_shard(
                    moe.router_module(),
                    mesh=dense_mesh,
                    mp_policy=fp32,
                    reshard_after_forward=fsdp.reshard_after_forward,
                    offload_policy=offload,
                )
            else:
                unit = fully_shard(
                    moe.experts_module(),
                    mesh=expert_mesh,
                    mp_policy=mp,
                    reshard_after_forward=fsdp.reshard_after_forward,
                    offload_policy=offload,
                    shard_placement_fn=_shard_placement_for_experts(expert_mesh),
                )
            nested.append(unit)
        target = unwrap_block(block) if block_plan.fsdp_unit is FSDPUnit.BLOCK else block
        block_unit = fully_shard(
            target,
            mesh=dense_mesh,
            mp_policy=mp,
            reshard_after_forward=fsdp.reshard_after_forward,
            offload_policy=offload,
        )
        units.extend(nested)
        units.append(block_unit)
        block_units.append(block_unit)
        nested_by_block.append(nested)
    root = fully_shard(model, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)
    units.append(root)
    if callable(getattr(model, "embed_inputs", None)):
        # Vision-language models embed the full micro batch (vision tower + token table) before the sequence is
        # sharded for context parallel: the root unit must unshard for that method as for forward.
        register_fsdp_forward_method(model, "embed_inputs")
    for unit in units:
        # Plain SUM collectives (no PREMUL_SUM, which gloo lacks; no AVG): the loss is already normalized.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    _set_prefetch(block_units, nested_by_block, forward=fsdp.forward_prefetch, backward=fsdp.backward_prefetch)
    return units


def _set_prefetch(blocks: list[FSDPModule], nested: list[list[FSDPModule]], *, forward: str, backward: str) -> None:
    """Explicit prefetch: each block all-gathers the next block and its nested units (forward) / the previous
    block and its nested units (backward). This is the layout where FSDP's all-gather runs only in recompute."""
    if forward == "explicit":
        for i, block in enumerate(blocks[:-1]):
            block.set_modules_to_forward_prefetch([blocks[i + 1], *nested[i + 1]])
    if backward == "explicit":
        for i in range(1, len(blocks)):
            blocks[i].set_modules_to_backward_prefetch([blocks[i - 1], *nested[i - 1]])


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduces gradients (FSDP2 ``set_requires_gradient_sync`` on every unit of the
    model: nested expert / router units and the blocks too). A model without FSDP units is left alone."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled, recurse=True)
