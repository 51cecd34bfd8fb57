"""An estimate of one step's time and MFU on a named GPU, from the counted op stream: never a measurement.

Compute: every op of the step on the roofline, ``max(FLOPs / (peak x MATMUL_EFFICIENCY), bytes / (HBM x
HBM_EFFICIENCY))`` with the peak of its input dtype (bf16 tensor cores, or fp32 for fp32 matmuls as torch runs them
by default), summed in op order: the eager op stream, elementwise ops unfused (torch.compile fuses many of them, so
memory-bound time is an upper bound where the recipe compiles).

Communication: each collective's wire bytes (``StepCounter``: ring model) over NVLink when its group lies inside one
node of ``gpus_per_node`` GPUs, else over the network (all-to-all: the bytes to peers in other nodes over the network,
the rest over NVLink, whichever takes longer), at ``LINK_EFFICIENCY``, plus ``COLLECTIVE_LATENCY_S`` per call.

Two bounds are given: ``step_s`` (every op as the eager stream runs it) and ``step_fused_s`` (only ops that do FLOPs
cost time: every elementwise op fused into a neighbour, which torch.compile approaches but never reaches).

Overlap: FSDP2's all-gathers and reduce-scatters (and HSDP's all-reduce) run on their own streams and are hidden
behind compute (step = max(compute, FSDP) + the rest); EP all-to-alls, CP exchanges and the loop's all-reduces are
on the critical path.

Host link: copies between the device and host memory (``OpCost.link == "host"``) cross the GPU's PCIe link at
``LINK_EFFICIENCY``. Activation offload's copies run on a side stream (hidden behind compute like FSDP's
collectives); the offloaded optimizer states' copies are issued on the compute stream around the update
(``train.optimizer_offload: states``) and are on the critical path. With ``train.optimizer_offload: full`` FSDP2
copies each unit's fp32 shard to the device at each unshard and each reduced gradient back, on its own streams
(hidden), except where a later micro batch's gradient is added to the host's on the CPU (``link ==
"host_blocking"``: FSDP2 waits for that copy); the update then runs on the host (``link == "host_memory"``) at
``HOST_MEMORY_EFFICIENCY`` of the node's DRAM bandwidth, shared by its ``gpus_per_node`` ranks, on the critical path.

torch's ``RuntimeEstimator`` is not used: it reads the peak of the current CUDA device, which a CPU process does
not have, and cannot be pointed at another GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_ac.simulate.counters import CollectiveRecord, StepCounts
from nemo_ac.simulate.gpus import (
    COLLECTIVE_LATENCY_S,
    HBM_EFFICIENCY,
    HOST_MEMORY_EFFICIENCY,
    LINK_EFFICIENCY,
    MATMUL_EFFICIENCY,
    GpuSpec,
)


@dataclass
class StepEstimate:
    gpu: str
    compute_s: float  # every op of the eager stream on the roofline
    compute_fused_s: float  # only ops that do FLOPs (matmuls, attention, kernels): every elementwise op fused away
    comm_s: dict[str, float] = field(default_factory=dict)  # mesh dimension -> seconds
    overlapped_s: float = 0.0
    exposed_s: float = 0.0
    step_s: float = 0.0
    model_flops: int = 0  # per rank: forward + backward (no recompute): what MFU divides
    executed_flops: int = 0  # per rank, recompute and optimizer included
    peak_flops: float = 0.0
    by_op: dict[str, float] = field(default_factory=dict)  # op name -> seconds of compute (the roofline's)
    host_overlapped_s: float = 0.0  # host-link copies on a side stream (activation offload)
    host_exposed_s: float = 0.0  # host-link copies on the compute stream (offloaded optimizer states)
    host_step_s: float = 0.0  # ops on host memory (the optimizer step over host shards), on the critical path

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.peak_flops) if self.step_s else 0.0

    @property
    def step_fused_s(self) -> float:
        """The step if compilation fused every elementwise op into its neighbours (a lower bound)."""
        return (
            max(self.compute_fused_s, self.overlapped_s, self.host_overlapped_s)
            + self.exposed_s
            + self.host_exposed_s
            + self.host_step_s
        )

    @property
    def mfu_fused(self) -> float:
        return self.model_flops / (self.step_fused_s * self.peak_flops) if self.step_fused_s else 0.0

    def dominant(self, count: int = 3) -> list[tuple[str, float]]:
        return sorted(self.by_op.items(), key=lambda kv: -kv[1])[:count]

    @property
    def hfu(self) -> float:
        return self.executed_flops / (self.step_s * self.peak_flops) if self.step_s else 0.0


def _within_node(ranks: tuple[int, ...], per_node: int) -> bool:
    return len({rank // per_node for rank in ranks}) <= 1


def collective_seconds(record: CollectiveRecord, kind: str, *, gpu: GpuSpec) -> float:
    """Time of ``record``'s calls on ``gpu``'s links (module docstring)."""
    nvlink = gpu.nvlink_bytes_per_s * LINK_EFFICIENCY
    network = gpu.network_bytes_per_s * LINK_EFFICIENCY
    latency = record.calls * COLLECTIVE_LATENCY_S
    ranks = record.ranks or (0,)
    if _within_node(ranks, gpu.gpus_per_node):
        return latency + record.wire_bytes / nvlink
    if kind != "all_to_all":
        return latency + record.wire_bytes / network
    peers = len(ranks) - 1
    node = ranks[0] // gpu.gpus_per_node
    same_node = sum(1 for rank in ranks[1:] if rank // gpu.gpus_per_node == node)
    remote = record.wire_bytes * (peers - same_node) / max(peers, 1)
    return latency + max(remote / network, (record.wire_bytes - remote) / nvlink)


def estimate_step(counts: StepCounts, *, gpu: GpuSpec) -> StepEstimate:
    """The estimate for one rank's counted step (module docstring)."""
    hbm = gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    host_link = gpu.host_link_bytes_per_s * LINK_EFFICIENCY
    host_memory = gpu.host_memory_bytes_per_s * HOST_MEMORY_EFFICIENCY / gpu.gpus_per_node
    compute = fused = host_overlapped = host_exposed = host_step = 0.0
    by_op: dict[str, float] = {}
    for cost in counts.costs:
        if cost.link == "host_memory":
            host_step += cost.weight * cost.bytes / host_memory
            continue
        if cost.link in ("host", "host_blocking"):
            seconds = cost.weight * cost.bytes / host_link
            if cost.phase == "optimizer" or cost.link == "host_blocking":
                host_exposed += seconds
            else:
                host_overlapped += seconds
            continue
        flop_s = cost.flops / (gpu.matmul_flops(cost.bits) * MATMUL_EFFICIENCY) if cost.flops else 0.0
        byte_s = cost.bytes / hbm
        seconds = cost.weight * max(flop_s, byte_s)
        compute += seconds
        by_op[cost.name] = by_op.get(cost.name, 0.0) + seconds
        if cost.flops:
            fused += seconds
    per_dim: dict[str, float] = {}
    overlapped = exposed = 0.0
    for (dim, kind, hidden), record in counts.collectives.items():
        seconds = collective_seconds(record, kind, gpu=gpu)
        per_dim[dim] = per_dim.get(dim, 0.0) + seconds
        if hidden:
            overlapped += seconds
        else:
            exposed += seconds
    return StepEstimate(
        gpu=gpu.name,
        compute_s=compute,
        compute_fused_s=fused,
        comm_s=per_dim,
        overlapped_s=overlapped,
        exposed_s=exposed,
        step_s=max(compute, overlapped, host_overlapped) + exposed + host_exposed + host_step,
        model_flops=counts.model_flops,
        executed_flops=counts.total_flops,
        peak_flops=gpu.bf16_flops,
        by_op=by_op,
        host_overlapped_s=host_overlapped,
        host_exposed_s=host_exposed,
        host_step_s=host_step,
    )
