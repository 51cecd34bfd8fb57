"""Device meshes from the resolved layout.

Dense parameters shard over ``dp_shard x cp`` (flattened ``dp_shard_cp``; HSDP adds ``dp_replicate``). Data differs
across ``dp = dp_replicate x dp_shard``; ``cp`` ranks see slices of the same sequences. Experts borrow ``ep`` from
``dp_shard x cp``: their mesh is ``(dp_replicate,) ep_shard x ep`` with ``ep_shard = dp_shard*cp/ep``, built as its own
view of the same root mesh so that the EP DTensor placement and the expert FSDP mesh share a parent (FSDP2
requires that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nemo_ac.config.layout import ParallelLayout


@dataclass
class ParallelMeshes:
    layout: ParallelLayout
    device_type: str
    world: DeviceMesh
    dense_fsdp: DeviceMesh
    dp: DeviceMesh
    cp: DeviceMesh | None
    experts: DeviceMesh | None

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def cp_rank(self) -> int:
        return self.cp.get_local_rank() if self.cp is not None else 0

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        return self.experts["ep"] if self.experts is not None else None

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """Mesh over which expert parameters are fully_shard-ed (the dense mesh when ep == 1)."""
        if self.experts is None:
            return self.dense_fsdp
        if self.layout.dp_replicate > 1:
            return self.experts["dp_replicate", "ep_shard"]
        return self.experts["ep_shard"]

    @property
    def loss_group(self) -> dist.ProcessGroup:
        """All ranks whose tokens make up one global batch (dp x cp): the whole world here."""
        return dist.group.WORLD


def build_meshes(layout: ParallelLayout, *, device_type: str) -> ParallelMeshes:
    """One root mesh ``(dp_replicate, dp_shard_cp)``, unflattened two ways: ``(dp_shard, cp)`` for data and
    sequence sharding, ``(ep_shard, ep)`` for experts. Both views share the root, as FSDP2 requires of the EP
    placement mesh and the expert FSDP mesh."""
    shard_cp = layout.dp_shard * layout.cp
    root = init_device_mesh(
        device_type, (layout.dp_replicate, shard_cp), mesh_dim_names=("dp_replicate", "dp_shard_cp")
    )
    data_view = root._unflatten(1, (layout.dp_shard, layout.cp), ("dp_shard", "cp"))
    dp = data_view["dp_replicate", "dp_shard"]._flatten("dp")
    dense_fsdp = root if layout.dp_replicate > 1 else root["dp_shard_cp"]
    cp = data_view["cp"] if layout.cp > 1 else None
    experts = None
    if layout.ep > 1:
        experts = root._unflatten(1, (layout.ep_shard, layout.ep), ("ep_shard", "ep"))
    return ParallelMeshes(
        layout=layout, device_type=device_type, world=root, dense_fsdp=dense_fsdp, dp=dp, cp=cp, experts=experts
    )
