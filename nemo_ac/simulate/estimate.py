"""An estimate of one step's time and MFU on a named GPU, from the counted op stream: never a measurement.

Compute: every op of the step on the roofline, ``max(FLOPs / (peak x efficiency), bytes / (HBM x HBM_EFFICIENCY))``
with the peak of its input dtype (bf16 tensor cores, or fp32 for fp32 matmuls as torch runs them by default), summed
in op order; an op's bytes are those it moves as it will run (below). The efficiency is per op class: dense GEMMs
(``DENSE_GEMMS``) at ``MATMUL_EFFICIENCY``, every other op with FLOPs (grouped expert GEMMs, attention, SSM scans:
kernels whose speed depends on their shape more than a large GEMM's) at ``KERNEL_EFFICIENCY``, the one constant
calibrated on a published measurement (``gpus``; ``benchmarks/plan_calibration.py``).

Communication: each collective's wire bytes (``StepCounter``: ring model) over NVLink when its group lies inside one
node of ``gpus_per_node`` GPUs, else over the network (all-to-all: the bytes to peers in other nodes over the network,
the rest over NVLink, whichever takes longer), at ``LINK_EFFICIENCY``, plus ``COLLECTIVE_LATENCY_S`` per call.
DeepEP's dispatch and combine (kind ``deepep``) send one copy of a token per destination rank over NVLink and one
per destination node over RDMA (forwarded over NVLink inside it); the two run pipelined, so the longer one counts.

The estimate is one number, ``step_s``: ops inside the blocks the plan compiles cost the bytes that torch.compile's
fusion leaves (``simulate.fusion``: a fused op reads only materialized tensors and writes only what something needs
in memory), every other op its eager bytes. Two bounds are printed beside it, for orientation only: ``step_eager_s``
(every op as the eager stream runs it) and ``step_fused_s`` (only ops that do FLOPs cost time).

Overlap: FSDP2's all-gathers and reduce-scatters (and HSDP's all-reduce) run on their own streams and are hidden
behind compute (step = max(compute, FSDP) + the rest); EP all-to-alls, CP exchanges and the loop's all-reduces are
on the critical path, except where the code issues one asynchronously and reads its output later: DeepEP's
transfers between compiled graphs (``async_finish``) run behind the shared expert, which ``MoE.forward`` computes
between each transfer's start and its wait, forward and backward (``comm_overlap``).

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

from nemo_ac.simulate.counters import CollectiveCall, CollectiveRecord, StepCounts
from nemo_ac.simulate.gpus import (
    COLLECTIVE_LATENCY_S,
    DEEPEP_SMS,
    HBM_EFFICIENCY,
    HOST_MEMORY_EFFICIENCY,
    KERNEL_EFFICIENCY,
    LINK_EFFICIENCY,
    MATMUL_EFFICIENCY,
    GpuSpec,
)
from nemo_ac.simulate.op_cost import OpCost


@dataclass
class StepEstimate:
    gpu: str
    compute_s: float  # the estimate: compiled blocks' ops at the bytes fusion leaves, the rest eager
    compute_eager_s: float  # every op of the eager stream on the roofline (an upper bound)
    compute_fused_s: float  # only ops that do FLOPs (matmuls, attention, kernels): every elementwise op fused away
    comm_s: dict[str, float] = field(default_factory=dict)  # mesh dimension -> seconds
    overlapped_s: float = 0.0
    exposed_s: float = 0.0
    step_s: float = 0.0
    model_flops: int = 0  # per rank: forward + backward (no recompute): what MFU divides
    executed_flops: int = 0  # per rank, recompute and optimizer included
    peak_flops: float = 0.0
    by_op: dict[str, float] = field(default_factory=dict)  # op name -> seconds of the estimate's compute
    host_overlapped_s: float = 0.0  # host-link copies on a side stream (activation offload)
    host_exposed_s: float = 0.0  # host-link copies on the compute stream (offloaded optimizer states)
    host_step_s: float = 0.0  # ops on host memory (the optimizer step over host shards), on the critical path
    # Of exposed_s: what asynchronous calls (DeepEP's transfers) spend behind compute (``comm_overlap``).
    comm_overlap_s: float = 0.0

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.peak_flops) if self.step_s else 0.0

    def _step_with(self, compute: float) -> float:
        return (
            max(compute, self.overlapped_s, self.host_overlapped_s)
            + self.exposed_s
            - self.comm_overlap_s
            + self.host_exposed_s
            + self.host_step_s
        )

    @property
    def step_fused_s(self) -> float:
        """The step if compilation fused every elementwise op into its neighbours (a lower bound)."""
        return self._step_with(self.compute_fused_s)

    @property
    def step_eager_s(self) -> float:
        """The step with every op as the eager stream runs it (an upper bound)."""
        return self._step_with(self.compute_eager_s)

    @property
    def mfu_fused(self) -> float:
        return self.model_flops / (self.step_fused_s * self.peak_flops) if self.step_fused_s else 0.0

    def dominant(self, count: int = 3) -> list[tuple[str, float]]:
        return sorted(self.by_op.items(), key=lambda kv: -kv[1])[:count]

    @property
    def hfu(self) -> float:
        return self.executed_flops / (self.step_s * self.peak_flops) if self.step_s else 0.0


# Ops that are dense GEMMs (cuBLAS): the op class MATMUL_EFFICIENCY applies to. The fp32 router's bf16x3 ops are
# one cuBLAS GEMM each, over the three weight pieces stacked (models.kernels.bf16x3_linear).
DENSE_GEMMS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "bf16x3_linear", "bf16x3_linear_backward"}
)


def _within_node(ranks: tuple[int, ...], per_node: int) -> bool:
    return len({rank // per_node for rank in ranks}) <= 1


def collective_seconds(record: CollectiveRecord, kind: str, *, gpu: GpuSpec) -> float:
    """Time of ``record``'s calls on ``gpu``'s links (module docstring).

    The link efficiency is not calibrated: NCCL's bus bandwidth on messages of several MiB."""
    nvlink = gpu.nvlink_bytes_per_s * LINK_EFFICIENCY
    network = gpu.network_bytes_per_s * LINK_EFFICIENCY
    latency = record.calls * COLLECTIVE_LATENCY_S
    ranks = record.ranks or (0,)
    if kind == "deepep":  # NVLink copies per destination rank; RDMA copies per destination node, pipelined
        return latency + max(record.wire_bytes / nvlink, record.network_bytes / network)
    if _within_node(ranks, gpu.gpus_per_node):
        return latency + record.wire_bytes / nvlink
    if kind != "all_to_all":
        return latency + record.wire_bytes / network
    peers = len(ranks) - 1
    node = ranks[0] // gpu.gpus_per_node
    same_node = sum(1 for rank in ranks[1:] if rank // gpu.gpus_per_node == node)
    remote = record.wire_bytes * (peers - same_node) / max(peers, 1)
    return latency + max(remote / network, (record.wire_bytes - remote) / nvlink)


def call_seconds(call: CollectiveCall, *, gpu: GpuSpec) -> float:
    """One collective call's time on ``gpu``'s links (``collective_seconds`` of a one-call record)."""
    record = CollectiveRecord(calls=1, wire_bytes=call.wire_bytes, network_bytes=call.network_bytes, ranks=call.ranks)
    return collective_seconds(record, call.kind, gpu=gpu)


def cost_seconds(
    cost: OpCost, *, gpu: GpuSpec, kernel_efficiency: float = KERNEL_EFFICIENCY, eager: bool = False
) -> float:
    """One cost's seconds, ``weight`` times (module docstring): the roofline of a compute op (``eager``: at its
    eager bytes), the host link for a copy to or from host memory, the node's DRAM for an op on host memory."""
    if cost.link == "host_memory":
        return cost.weight * cost.bytes / (gpu.host_memory_bytes_per_s * HOST_MEMORY_EFFICIENCY / gpu.gpus_per_node)
    if cost.link in ("host", "host_blocking"):
        return cost.weight * cost.bytes / (gpu.host_link_bytes_per_s * LINK_EFFICIENCY)
    efficiency = MATMUL_EFFICIENCY if cost.name in DENSE_GEMMS else kernel_efficiency
    flop_s = cost.flops / (gpu.matmul_flops(cost.bits) * efficiency) if cost.flops else 0.0
    moved = cost.bytes if eager else cost.fused_bytes
    return cost.weight * max(flop_s, moved / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY))


def comm_overlap(counts: StepCounts, *, gpu: GpuSpec, kernel_efficiency: float = KERNEL_EFFICIENCY) -> float:
    """Seconds of the blocking collectives that asynchronous calls spend behind compute: a call issued at cost ``at``
    and first read at ``read_at`` (``CollectiveCall.read_at``: DeepEP's transfers with ``async_finish``) runs
    beside the compute in between, W seconds on its own. DeepEP's kernels hold ``DEEPEP_SMS`` of the GPU's SMs (a
    fraction f), so that compute runs on the rest: of a transfer of C seconds, min(W, (1 - f) C) leaves the critical
    path (all of W when it is the shorter; else the transfer's time less what it slowed the compute)."""
    busy = DEEPEP_SMS / gpu.sms
    hidden = 0.0
    for call in counts.calls:
        if call.read_at is None or call.overlapped or call.read_at <= call.at:
            continue
        window = sum(
            cost_seconds(cost, gpu=gpu, kernel_efficiency=kernel_efficiency) / cost.weight
            for cost in counts.costs[call.at : call.read_at]
            if cost.weight and not cost.link
        )
        hidden += call.weight * min(window, (1 - busy) * call_seconds(call, gpu=gpu))
    return hidden


def estimate_step(counts: StepCounts, *, gpu: GpuSpec, kernel_efficiency: float = KERNEL_EFFICIENCY) -> StepEstimate:
    """The estimate for one rank's counted step (module docstring); ``kernel_efficiency`` is the one calibrated
    constant (``gpus.KERNEL_EFFICIENCY``), a parameter so that the calibration can solve for it."""
    compute = eager = fused = host_overlapped = host_exposed = host_step = 0.0
    by_op: dict[str, float] = {}
    for cost in counts.costs:
        seconds = cost_seconds(cost, gpu=gpu, kernel_efficiency=kernel_efficiency)
        if cost.link == "host_memory":
            host_step += seconds
            continue
        if cost.link in ("host", "host_blocking"):
            if cost.phase == "optimizer" or cost.link == "host_blocking":
                host_exposed += seconds
            else:
                host_overlapped += seconds
            continue
        eager_seconds = cost_seconds(cost, gpu=gpu, kernel_efficiency=kernel_efficiency, eager=True)
        compute += seconds
        eager += eager_seconds
        by_op[cost.name] = by_op.get(cost.name, 0.0) + seconds
        if cost.flops:
            fused += eager_seconds
    per_dim: dict[str, float] = {}
    overlapped = exposed = 0.0
    for (dim, kind, hidden), record in counts.collectives.items():
        seconds = collective_seconds(record, kind, gpu=gpu)
        per_dim[dim] = per_dim.get(dim, 0.0) + seconds
        if hidden:
            overlapped += seconds
        else:
            exposed += seconds
    estimate = StepEstimate(
        gpu=gpu.name,
        compute_s=compute,
        compute_eager_s=eager,
        compute_fused_s=fused,
        comm_s=per_dim,
        overlapped_s=overlapped,
        exposed_s=exposed,
        model_flops=counts.model_flops,
        executed_flops=counts.total_flops,
        peak_flops=gpu.bf16_flops,
        by_op=by_op,
        host_overlapped_s=host_overlapped,
        host_exposed_s=host_exposed,
        host_step_s=host_step,
        comm_overlap_s=comm_overlap(counts, gpu=gpu, kernel_efficiency=kernel_efficiency),
    )
    estimate.step_s = estimate._step_with(compute)
    return estimate


def calibrated_kernel_efficiency(counts: StepCounts, *, gpu: GpuSpec, measured_step_s: float) -> float:
    """The kernel efficiency at which ``counts``' estimated step equals ``measured_step_s`` (bisection: the step
    falls as the efficiency rises). Raises ValueError when no efficiency in (0, 1] reaches it."""
    low, high = 1e-3, 1.0
    if estimate_step(counts, gpu=gpu, kernel_efficiency=high).step_s > measured_step_s:
        raise ValueError(f"even at 100% of the tensor peak the estimate exceeds {measured_step_s} s")
    for _ in range(60):
        middle = (low + high) / 2
        if estimate_step(counts, gpu=gpu, kernel_efficiency=middle).step_s > measured_step_s:
            low = middle
        else:
            high = middle
    return high
