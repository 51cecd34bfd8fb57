"""Context parallel (ulysses, ring): attention ops swapped into the model and input sharding.

Not available yet: lands with the context-parallel issue.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def apply_cp(model: nn.Module, *, cp_mesh: DeviceMesh | None, cp_type: str) -> None:
    if cp_mesh is None:
        return
    raise NotImplementedError("context parallel (parallel.cp > 1) is not available yet")
