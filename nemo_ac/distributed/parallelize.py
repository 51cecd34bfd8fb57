"""The parallelization recipe: EP -> CP -> AC (+ activation offloading) -> compile -> FSDP, each step one function."""

from __future__ import annotations

from torch import nn

from nemo_ac.config.schema import (
    ActivationCheckpointingConfig,
    BackendConfig,
    CompileConfig,
    ModelConfig,
    ParallelConfig,
)
from nemo_ac.distributed.activation_checkpointing import apply_ac, install_sac_fsdp_workarounds
from nemo_ac.distributed.blocks import decoder_layers
from nemo_ac.distributed.compile import apply_compile, plan_layouts, recompute_context_fns
from nemo_ac.distributed.context_parallel import apply_cp
from nemo_ac.distributed.expert_parallel import apply_ep
from nemo_ac.distributed.fsdp import apply_fsdp
from nemo_ac.distributed.mesh import ParallelMeshes
from nemo_ac.distributed.offload import apply_offload
from nemo_ac.models.common.te_backend import apply_te_backends


def parallelize(
    model: nn.Module,
    *,
    meshes: ParallelMeshes,
    model_config: ModelConfig,
    parallel: ParallelConfig,
    activation_checkpointing: ActivationCheckpointingConfig,
    compile: CompileConfig,
    backend: BackendConfig,
) -> nn.Module:
    """Apply every parallelism to a meta-device model in place (weights are materialized afterwards)."""
    # Kernel backends first (backend.*: te swaps Transformer Engine modules into the blocks; torch: nothing).
    apply_te_backends(decoder_layers(model), backend=backend)
    apply_ep(model, ep_mesh=meshes.ep_mesh, dispatcher=backend.dispatcher, moe=model_config.moe)
    apply_cp(model, cp_mesh=meshes.cp, cp_type=parallel.cp_type)
    # Compile layouts are decided per block before AC wraps it: only AC(compile(block)) gets the forward-thread
    # compile context in its checkpoint.
    layouts = plan_layouts(
        model, config=compile, moe=model_config.moe, activation_checkpointing=activation_checkpointing
    )
    apply_ac(
        model,
        config=activation_checkpointing,
        extra_context_fns=recompute_context_fns(compile, layouts=layouts),
        moe=model_config.moe,
    )
    # On the AC wrapper (outside the checkpoint), so it sees the block inputs full AC saves (offload.py).
    apply_offload(model, enabled=activation_checkpointing.offload)
    apply_compile(model, config=compile, layouts=layouts)
    apply_fsdp(
        model,
        dense_mesh=meshes.dense_fsdp,
        expert_mesh=meshes.expert_fsdp,
        config=parallel.fsdp,
        moe=model_config.moe,
        shard_inner_block=activation_checkpointing.placement == "outside",
    )
    # After fully_shard: FSDP2's forward hooks run outside the SAC modes (torch 2.13 SAC desync, sac_compat).
    install_sac_fsdp_workarounds(model, config=activation_checkpointing)
    return model
