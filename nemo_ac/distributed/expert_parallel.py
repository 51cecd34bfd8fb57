"""Expert parallel: experts sharded over ``ep``, tokens dispatched / combined with all-to-all.

Not available yet: lands with the expert-parallel issue.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nemo_ac.config.schema import MoEConfig


def apply_ep(model: nn.Module, *, ep_mesh: DeviceMesh | None, dispatcher: str, moe: MoEConfig) -> None:
    if ep_mesh is None and dispatcher == "torch":
        return
    raise NotImplementedError("expert parallel (parallel.ep > 1, backend.dispatcher) is not available yet")
