"""One compute op as the step estimate prices it: its FLOPs, the bytes it touches eagerly and inside a compiled
block, and where those bytes go. A module of its own because both the counters that make it
(``simulate.counters``) and the fusion model that sets its compiled bytes (``simulate.fusion``) need it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OpCost:
    """One compute op for the roofline: FLOPs, bytes touched, the bits of its lowest-precision floating input (the
    tensor cores its products run on); ``weight``: how many times it counts (micro batches counted but not run; depth
    scaling, where it may be negative)."""

    flops: int
    bytes: int
    bits: int
    phase: str
    weight: int = 1
    name: str = ""
    # "host": a copy between the device and host memory (the dry run's host stand-in, "meta"): it crosses the GPU's
    # host link, not HBM; ``bytes`` is then the payload, one direction. "host_blocking": the same, with the compute
    # stream waiting for it (FSDP2's gradient copy to host shards; an offloaded activation copied back on demand).
    # "host_memory": an op on tensors in host memory (the optimizer step over the shards
    # ``train.optimizer_offload: full`` keeps there): the node's DRAM bandwidth, shared by its ranks.
    link: str = ""
    # The bytes left when the op runs inside a compiled block (``simulate.fusion``); None: ``bytes`` (eager).
    compiled_bytes: int | None = None
    seq: int = 0  # the counter's running op number (a memory sample's ``seq`` places it on the trace)

    @property
    def fused_bytes(self) -> int:
        return self.bytes if self.compiled_bytes is None else self.compiled_bytes
