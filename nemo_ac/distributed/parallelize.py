"""The parallelization recipe: a decided plan applied as kernels -> EP -> CP -> AC (+ offload) -> compile -> FSDP,
each one step.

The plan is decided before (``distributed.plan.decide_plan``, from the recipe's sections: the composition root,
``trainer.build``, is the one caller that hands them over); ``parallelize`` takes the plan and the meshes only and
returns the plan with what applying it produced (``ParallelPlan.applied``); the run prints
``plan.summary_lines()`` and reads the offloader and the compiled checkpoint entries from there.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from nemo_ac.distributed.activation_checkpointing import apply_ac, install_sac_fsdp_workarounds
from nemo_ac.distributed.apply_kernels import apply_kernels
from nemo_ac.distributed.compile import apply_compile
from nemo_ac.distributed.context_parallel import apply_cp
from nemo_ac.distributed.expert_parallel import apply_ep
from nemo_ac.distributed.fsdp import apply_fsdp
from nemo_ac.distributed.mesh import ParallelMeshes
from nemo_ac.distributed.offload import apply_offload
from nemo_ac.distributed.plan import AppliedPlan, ParallelPlan


def parallelize(
    model: nn.Module, *, plan: ParallelPlan, meshes: ParallelMeshes, deepep_buffer_cls: type | None = None
) -> ParallelPlan:
    """Apply a decided plan (``distributed.plan.decide_plan``) to a meta-device model in place (weights are
    materialized afterwards); returns the plan with ``applied`` filled in. Every step reads the plan alone.
    ``deepep_buffer_cls``: the ``deep_ep.Buffer`` the DeepEP dispatcher uses (None: DeepEP's; the dry run's has none)."""
    apply_kernels(model, plan=plan)  # first: the ops the plan chose, before EP and CP wrap them
    apply_ep(model, plan=plan, ep_mesh=meshes.ep_mesh, deepep_buffer_cls=deepep_buffer_cls)
    apply_cp(model, plan=plan, cp_mesh=meshes.cp)
    apply_ac(model, plan=plan)
    # On the AC wrapper (outside the checkpoint), so it sees the block inputs full AC saves (offload.py).
    offloader = apply_offload(model, enabled=plan.offload_in_flight > 0, in_flight=plan.offload_in_flight)
    compiled = apply_compile(model, plan=plan)
    units = apply_fsdp(model, plan=plan, dense_mesh=meshes.dense_fsdp, expert_mesh=meshes.expert_fsdp)
    # After fully_shard: FSDP2's forward hooks run outside the SAC modes (workarounds.fsdp_hooks_in_sac).
    bracketed = install_sac_fsdp_workarounds(model, plan=plan)
    applied = AppliedPlan(
        offloader=offloader,
        compiled_checkpoint_entries=tuple(sorted({c.checkpoint_entry for c in compiled if c.checkpoint_entry})),
        fsdp_units=len(units),
        fsdp_units_bracketed=bracketed,
    )
    return dataclasses.replace(plan, applied=applied)
