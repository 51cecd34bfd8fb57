"""The GPUs ``nemo-ac plan --gpu`` estimates for: datasheet numbers and the efficiency assumptions applied to them.

Every number is a datasheet figure (sources beside each entry) except the memory, which is the total nvidia-smi
reports on that GPU (less than the marketing GB: firmware reserves part of it); ``RESERVED_BYTES`` of it are taken
off for the CUDA context and the allocator. The estimate applies three stated efficiencies instead of pretending a datasheet peak
is reached: dense GEMMs at ``MATMUL_EFFICIENCY`` of the tensor peak, other kernels with FLOPs at
``KERNEL_EFFICIENCY`` (calibrated: below), memory-bound ops at ``HBM_EFFICIENCY`` of the
HBM bandwidth, collectives at ``LINK_EFFICIENCY`` of the link bandwidth (NCCL's bus bandwidth on large messages).
None of them has been measured by nemo_ac on a GPU yet: ``benchmarks/gpu_check.sh`` prints the plan's estimate
beside a measured step so they can be checked where a GPU is available.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_ac.config.errors import ConfigError, ConfigIssue

MiB = 2**20
GiB = 2**30
TERA = 1e12
GIGA = 1e9

# Fractions of the datasheet peaks a well-tuned step reaches (printed with every estimate). All but one are
# assumptions; KERNEL_EFFICIENCY is calibrated.
MATMUL_EFFICIENCY = 0.75  # dense GEMMs (mm / addmm / bmm): large bf16 GEMMs on Hopper reach ~70-80% of the peak
# Every other op with FLOPs: grouped expert GEMMs, attention, SSM scans. CALIBRATED on one published measurement,
# NeMo Automodel's Qwen3 MoE 30B row (8 H100, EP8, 4 x 4096-token rows per micro batch, global batch 512, AC, TE,
# DeepEP, fake balanced gate: 21.773 s per step), shipped as benchmarks/recipes/qwen3_30b_a3b_automodel_ep8.yaml:
# the value at which the estimate of that row equals the measured step, rounded (`python
# benchmarks/plan_calibration.py` solves for it again and prints the estimate's error on every measured row).
KERNEL_EFFICIENCY = 0.44
HBM_EFFICIENCY = 0.85  # streaming elementwise kernels reach ~80-90% of HBM bandwidth
LINK_EFFICIENCY = 0.80  # NCCL bus bandwidth over NVLink / InfiniBand on messages of several MiB
# The optimizer step over shards kept in host memory (train.optimizer_offload: full) is bound by the node's DRAM
# bandwidth, shared by its ranks: a multi-threaded fused AdamW reaches about half the channels' peak (STREAM triad
# reaches ~70-80% on these CPUs; the step's 28 bytes per parameter are reads and writes of five separate arrays).
HOST_MEMORY_EFFICIENCY = 0.5
COLLECTIVE_LATENCY_S = 20e-6  # per collective call: launch + synchronization, NVLink or InfiniBand alike
GPUS_PER_NODE = 8  # every node in GPUS (DGX / HGX): what the dry run groups ranks into nodes by
# The CUDA context, cuBLAS / NCCL workspaces and the caching allocator's fragmentation: memory a step cannot use.
RESERVED_BYTES = 3 * GiB
# SMs DeepEP's normal (high-throughput) kernels occupy while they run: deep_ep.Buffer.num_sms, 20 by default. Compute
# overlapped with an asynchronous dispatch runs on the GPU's other SMs.
DEEPEP_SMS = 20


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model and its node: 8 GPUs per node over NVLink, one InfiniBand NIC per GPU across nodes."""

    name: str
    label: str
    memory_bytes: int  # the total nvidia-smi reports (what torch.cuda sees before the CUDA context)
    bf16_flops: float  # dense tensor-core peak (bf16 / fp16)
    tf32_flops: float  # dense tensor-core peak in tf32 (fp32 matmuls when allow_tf32)
    fp32_flops: float  # non-tensor fp32 peak (fp32 matmuls as torch runs them by default)
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per direction, per GPU
    network_bytes_per_s: float  # per direction, per GPU (one NIC each)
    host_link_bytes_per_s: float  # GPU <-> host memory per direction, per GPU (its PCIe link)
    host_memory_bytes: int  # the node's system memory (``nemo-ac plan --host-memory`` replaces it)
    host_memory_bytes_per_s: float  # the node's DRAM bandwidth (every channel of every CPU socket), all ranks share it
    gpus_per_node: int = GPUS_PER_NODE
    sms: int = 132  # streaming multiprocessors (H100 / H200 SXM: 132; B200: 148; A100: 108)
    source: str = ""

    def matmul_flops(self, dtype_bits: int, *, tf32: bool = False) -> float:
        """Peak FLOP/s of a matmul whose inputs have ``dtype_bits`` bits (16: bf16/fp16, 32: fp32)."""
        if dtype_bits <= 16:
            return self.bf16_flops
        return self.tf32_flops if tf32 else self.fp32_flops


GPUS: dict[str, GpuSpec] = {
    "h100-80gb": GpuSpec(
        name="h100-80gb",
        label="H100 SXM5 80GB",
        memory_bytes=81_559 * MiB,  # 79.6 GiB
        bf16_flops=989.4 * TERA,
        tf32_flops=494.7 * TERA,
        fp32_flops=66.9 * TERA,
        hbm_bytes_per_s=3.35e12,
        nvlink_bytes_per_s=450 * GIGA,  # NVLink 4: 900 GB/s bidirectional
        network_bytes_per_s=50 * GIGA,  # ConnectX-7 NDR 400 Gb/s per GPU
        host_link_bytes_per_s=64 * GIGA,  # PCIe Gen5 x16
        host_memory_bytes=2 * 1024 * GiB,  # DGX H100: 2 TB
        host_memory_bytes_per_s=2 * 8 * 38.4 * GIGA,  # 2x Xeon 8480C, 8 channels DDR5-4800 each
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5); DGX H100 user guide (8x ConnectX-7 400 Gb/s)",
    ),
    "h200-141gb": GpuSpec(
        name="h200-141gb",
        label="H200 SXM 141GB",
        memory_bytes=143_771 * MiB,  # 140.4 GiB
        bf16_flops=989.4 * TERA,
        tf32_flops=494.7 * TERA,
        fp32_flops=66.9 * TERA,
        hbm_bytes_per_s=4.8e12,
        nvlink_bytes_per_s=450 * GIGA,
        network_bytes_per_s=50 * GIGA,
        host_link_bytes_per_s=64 * GIGA,  # PCIe Gen5 x16
        host_memory_bytes=2 * 1024 * GiB,  # DGX H200: 2 TB
        host_memory_bytes_per_s=2 * 8 * 38.4 * GIGA,  # 2x Xeon 8480C, 8 channels DDR5-4800 each
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM); DGX H200 user guide (8x ConnectX-7 400 Gb/s)",
    ),
    "b200-180gb": GpuSpec(
        name="b200-180gb",
        label="B200 180GB",
        memory_bytes=183_359 * MiB,  # 179.1 GiB
        bf16_flops=2250 * TERA,
        tf32_flops=1125 * TERA,
        fp32_flops=75 * TERA,
        hbm_bytes_per_s=8.0e12,
        nvlink_bytes_per_s=900 * GIGA,  # NVLink 5: 1.8 TB/s bidirectional
        network_bytes_per_s=50 * GIGA,  # DGX B200: 8x ConnectX-7 400 Gb/s
        host_link_bytes_per_s=64 * GIGA,  # PCIe Gen5 x16
        host_memory_bytes=4 * 1024 * GiB,  # DGX B200: 4 TB
        host_memory_bytes_per_s=2 * 8 * 44.8 * GIGA,  # 2x Xeon 8570, 8 channels DDR5-5600 each
        sms=148,
        source="NVIDIA HGX B200 datasheet (per GPU, sparsity halved); DGX B200 user guide",
    ),
    "a100-80gb": GpuSpec(
        name="a100-80gb",
        label="A100 SXM4 80GB",
        memory_bytes=81_920 * MiB,  # 80.0 GiB
        bf16_flops=312 * TERA,
        tf32_flops=156 * TERA,
        fp32_flops=19.5 * TERA,
        hbm_bytes_per_s=2.039e12,
        nvlink_bytes_per_s=300 * GIGA,  # NVLink 3: 600 GB/s bidirectional
        network_bytes_per_s=25 * GIGA,  # DGX A100: 8x ConnectX-6 HDR 200 Gb/s
        host_link_bytes_per_s=32 * GIGA,  # PCIe Gen4 x16
        host_memory_bytes=2 * 1024 * GiB,  # DGX A100 640GB: 2 TB
        host_memory_bytes_per_s=2 * 8 * 25.6 * GIGA,  # 2x EPYC 7742, 8 channels DDR4-3200 each
        sms=108,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB); DGX A100 user guide",
    ),
}


# torch.cuda.get_device_name() -> the spec it is, first match wins: the PCIe / NVL H100s and the 40 GB A100 are
# other GPUs than the SXM parts the specs describe (other clocks, memory, links), so they match none.
_DEVICE_NAMES: tuple[tuple[str, str | None], ...] = (
    ("H100 NVL", None),
    ("H100 PCIe", None),
    ("H100", "h100-80gb"),  # "NVIDIA H100 80GB HBM3"
    ("H200", "h200-141gb"),  # "NVIDIA H200"
    ("B200", "b200-180gb"),  # "NVIDIA B200"
    ("A100-SXM4-80GB", "a100-80gb"),
)


def spec_for_device_name(device_name: str) -> GpuSpec | None:
    """The spec of the GPU torch names ``device_name``, or None where none describes it: a measured step is held
    against the estimate for the GPU it ran on, and no other."""
    for fragment, name in _DEVICE_NAMES:
        if fragment.lower() in device_name.lower():
            return GPUS[name] if name is not None else None
    return None


def gpu_spec(name: str, *, key: str = "--gpu") -> GpuSpec:
    """The spec called ``name`` (case-insensitive); a ``ConfigError`` naming the known ones otherwise."""
    spec = GPUS.get(name.strip().lower())
    if spec is None:
        raise ConfigError(ConfigIssue(key, f"unknown GPU {name!r}; use one of {', '.join(GPUS)}"))
    return spec


def assumptions_line(spec: GpuSpec) -> str:
    return (
        f"{spec.label}: {spec.bf16_flops / TERA:,.0f} TFLOP/s bf16 dense x {MATMUL_EFFICIENCY:.0%} for GEMMs, "
        f"x {KERNEL_EFFICIENCY:.0%} for other kernels (calibrated), "
        f"HBM {spec.hbm_bytes_per_s / 1e12:.2f} TB/s x {HBM_EFFICIENCY:.0%}, NVLink "
        f"{spec.nvlink_bytes_per_s / GIGA:,.0f} GB/s and network {spec.network_bytes_per_s / GIGA:,.0f} GB/s per "
        f"GPU per direction x {LINK_EFFICIENCY:.0%}, {spec.gpus_per_node} GPUs per node, "
        f"{COLLECTIVE_LATENCY_S * 1e6:.0f} us per collective, {RESERVED_BYTES / GiB:.0f} GiB reserved "
        f"(CUDA context, workspaces, fragmentation), host link {spec.host_link_bytes_per_s / GIGA:,.0f} GB/s per GPU "
        f"per direction x {LINK_EFFICIENCY:.0%}, host memory {spec.host_memory_bytes / GiB:,.0f} GiB per node"
    )
