"""What ``nemo-ac plan`` prints and writes: per-rank memory at the peak, FLOPs, collective bytes, an estimate per GPU.

Every estimated number is labelled as one, with its assumptions listed; measured properties of the dry run itself
(its wall time and peak RSS) are labelled as such.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_ac.simulate.estimate import StepEstimate, estimate_step
from nemo_ac.simulate.gpus import RESERVED_BYTES, GpuSpec, assumptions_line
from nemo_ac.simulate.peer_flops import PeerFlops, automodel_flops
from nemo_ac.simulate.run import Simulation

GiB = 2**30


def size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (tiny recipes read in KiB, flagships in GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def seconds(s: float) -> str:
    return f"{s:,.2f} s" if s >= 1 else f"{s * 1e3:,.2f} ms" if s >= 1e-3 else f"{s * 1e6:,.1f} us"


def decimal(n: float) -> str:
    """Network bytes in decimal units (link bandwidths are quoted in GB/s)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.3f} {unit}"
    return f"{n:,.0f} B"


# The recipe keys that shrink each memory term, for the "does not fit" message.
SHRINKS: dict[str, str] = {
    "activations": "train.micro_batch_size, activation_checkpointing.mode (selective -> full), parallel.cp, "
    "activation_checkpointing.offload (with mode full)",
    "temporaries": "train.micro_batch_size, parallel.cp, activation_checkpointing.mode",
    "optimizer states": "more ranks (parallel.dp_shard), parallel.ep (expert states), train.freeze",
    "optimizer step temporaries": "the built-in AdamW (fused on CUDA), a fused train.optimizer "
    "({_target_: torch.optim.AdamW, fused: true}) or more ranks (parallel.dp_shard)",
    "parameters": "more ranks (parallel.dp_shard), parallel.ep (expert weights)",
    "gradients": "more ranks (parallel.dp_shard), parallel.ep, train.freeze",
    "gathered parameters": "parallel.fsdp prefetch (fewer units gathered ahead), parallel.ep",
    "all-gather buffers": "parallel.fsdp prefetch, parallel.ep",
    "reduce-scatter buffers": "parallel.fsdp.reduce_dtype bfloat16",
    "DeepEP buffers": "backend.dispatcher torch",
    "inputs": "train.micro_batch_size",
}


@dataclass
class Fit:
    gpu: str
    usable_bytes: int
    peak_bytes: int
    host_bytes_per_node: int = 0  # what the node's ranks keep in host memory (Simulation.host_bytes)
    host_memory_bytes: int = 0  # the node's system memory (GpuSpec, or --host-memory)

    @property
    def device_fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    @property
    def host_fits(self) -> bool:
        return self.host_bytes_per_node <= self.host_memory_bytes

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.peak_bytes


def fit_on(simulation: Simulation, gpu: GpuSpec) -> Fit:
    ranks_per_node = min(simulation.layout.world_size, gpu.gpus_per_node)
    return Fit(
        gpu.name,
        gpu.memory_bytes - RESERVED_BYTES,
        simulation.measurement.peak.total_bytes,
        # On a CPU plan the host is the device: what it offloads is in the peak already.
        host_bytes_per_node=sum(simulation.host_bytes.values()) * ranks_per_node
        if simulation.device_type == "cuda"
        else 0,
        host_memory_bytes=gpu.host_memory_bytes,
    )


@dataclass
class PlanReport:
    simulation: Simulation
    gpus: list[GpuSpec]
    estimates: list[StepEstimate] = field(default_factory=list)
    fits: list[Fit] = field(default_factory=list)

    @classmethod
    def build(cls, simulation: Simulation, gpus: list[GpuSpec]) -> PlanReport:
        counts = simulation.measurement.counts
        return cls(
            simulation=simulation,
            gpus=gpus,
            estimates=[estimate_step(counts, gpu=gpu) for gpu in gpus],
            fits=[fit_on(simulation, gpu) for gpu in gpus],
        )

    @functools.cached_property
    def peer_flops(self) -> PeerFlops | None:
        """NeMo Automodel's model FLOPs per token for this recipe (``simulate.peer_flops``), when installed: computed
        for the printed and JSON report only (the layout search builds reports it never prints)."""
        return automodel_flops(self.simulation.recipe)

    def peer_tflops_per_gpu(self, estimate: StepEstimate) -> float | None:
        """The estimate's TFLOP/s per GPU by Automodel's formula (what its benchmark table prints)."""
        if self.peer_flops is None or not estimate.step_s:
            return None
        tokens_per_gpu = self.simulation.tokens_per_step / estimate.step_s / self.simulation.layout.world_size
        return self.peer_flops.flops_per_token * tokens_per_gpu / 1e12

    def lines(self) -> list[str]:
        sim = self.simulation
        m = sim.measurement
        peak = m.peak
        counts = m.counts
        layout = sim.layout
        out = [
            f"plan | {sim.recipe.name} | world {layout.world_size} = dp_replicate {layout.dp_replicate} x dp_shard "
            f"{layout.dp_shard} x cp {layout.cp} ({sim.recipe.parallel.cp_type}), ep {layout.ep} x ep_shard "
            f"{layout.ep_shard} | {sim.device_type} | dry run of rank 0 (fake process group, fake tensors)",
            *sim.plan.summary_lines(),
            f"memory | peak {size(peak.total_bytes)} per rank (tracked: torch FSDPMemTracker"
            + (", + hand-added" if peak.hand_added else "")
            + f"; at the peak: {peak.phase_at_peak})",
        ]
        for term, value in sorted(peak.terms.items(), key=lambda kv: -kv[1]):
            if value:
                out.append(f"memory |   {term:<24} {size(value):>12}")
        if peak.comm_bytes_at_peak:
            out.append(
                f"memory |   (activations and temporaries include {size(peak.comm_bytes_at_peak)} of EP / CP "
                "communication buffers)"
            )
        for extra in peak.hand_added:
            out.append(f"memory |   {extra.term:<24} {size(extra.bytes):>12}  added by hand: {extra.why}")
        if sim.host_bytes:
            terms = ", ".join(f"{term} {size(value)}" for term, value in sim.host_bytes.items())
            where = (
                "pinned host memory, off the device"
                if sim.device_type == "cuda"
                else "on a CPU run the host is the device: in the peak above too"
            )
            out.append(f"host | per rank: {terms} ({where})")
        mb = f"{m.micro_batches_run} of {m.micro_batches_per_step} micro batches run"
        if m.micro_batches_run < m.micro_batches_per_step:
            mb += f" (the other {m.micro_batches_per_step - m.micro_batches_run} counted as the last one run)"
        out.append(
            f"flops | {flops(counts.total_flops)} per rank per step executed = forward "
            f"{flops(counts.flops['forward'])} + backward {flops(counts.flops['backward'])} + recompute "
            f"{flops(counts.flops['recompute'])} (torch's FLOP formulas, as FlopCounterMode; {mb})"
        )
        if counts.without_formula:
            names = ", ".join(f"{name} x{count}" for name, count in sorted(counts.without_formula.items()))
            out.append(f"flops | WARNING: ops without a FLOP formula, counted as 0: {names}")
        for (dim, kind, hidden), record in sorted(counts.collectives.items()):
            out.append(
                f"comm | {dim:<20} {kind:<15} {record.calls:6d} calls {decimal(record.wire_bytes):>12} sent per rank "
                + (f"(NVLink; {decimal(record.network_bytes)} over RDMA) " if kind == "deepep" else "")
                + f"({decimal(record.payload_bytes)} buffers; {len(record.ranks)} ranks"
                + (", overlapped by FSDP)" if hidden else ", blocking)")
            )
        for estimate, fit in zip(self.estimates, self.fits, strict=True):
            verdict = "fits" if fit.device_fits else "DOES NOT FIT"
            dominant = ", ".join(f"{name} {seconds(spent)}" for name, spent in estimate.dominant())
            out.append(
                f"estimate | {estimate.gpu}: step {seconds(estimate.step_s)} (bounds: {seconds(estimate.step_eager_s)} "
                f"eager, {seconds(estimate.step_fused_s)} all fused) | MFU {estimate.mfu:.1%} | "
                f"{sim.tokens_per_step / estimate.step_s:,.0f} tokens/s, "
                f"{sim.tokens_per_step / estimate.step_s / layout.world_size:,.0f} per GPU | memory {verdict}: "
                f"{size(fit.peak_bytes)} of {size(fit.usable_bytes)} usable "
                f"(headroom {'+' if fit.device_fits else '-'}{size(abs(fit.headroom_bytes))})"
                + (
                    f" | host memory {'fits' if fit.host_fits else 'DOES NOT FIT'}: {size(fit.host_bytes_per_node)} "
                    f"per node of {size(fit.host_memory_bytes)}"
                    if fit.host_bytes_per_node
                    else ""
                )
            )
            out.append(
                f"estimate | {estimate.gpu}:   compute {seconds(estimate.compute_s)} (most: {dominant}); FSDP comm {seconds(estimate.overlapped_s)} "
                f"overlapped; blocking comm {seconds(estimate.exposed_s)}"
                + (
                    f" ({seconds(estimate.comm_overlap_s)} of it behind compute: async DeepEP transfers)"
                    if estimate.comm_overlap_s
                    else ""
                )
                + (
                    f"; host link {seconds(estimate.host_exposed_s)} blocking, "
                    f"{seconds(estimate.host_overlapped_s)} overlapped"
                    if estimate.host_exposed_s or estimate.host_overlapped_s
                    else ""
                )
                + (f"; optimizer step on the host {seconds(estimate.host_step_s)}" if estimate.host_step_s else "")
                + "".join(f"; {dim} {seconds(spent)}" for dim, spent in sorted(estimate.comm_s.items()))
            )
            peer_tflops = self.peer_tflops_per_gpu(estimate)
            if peer_tflops is not None and self.peer_flops is not None:
                out.append(
                    f"estimate | {estimate.gpu}:   by {self.peer_flops.describe()}: {peer_tflops:,.0f} TFLOP/s per GPU, "
                    f"MFU {peer_tflops * 1e12 / estimate.peak_flops:.1%} (the figures Automodel publishes)"
                )
        for gpu in self.gpus:
            out.append(f"assumes | {assumptions_line(gpu)}")
        out.append(
            "assumes | FSDP all-gather / reduce-scatter hidden behind compute; EP all-to-all, CP exchanges and the "
            "loop's all-reduces blocking (but an asynchronous DeepEP dispatch); the op stream on the roofline, compiled blocks at the bytes fusion leaves (an "
            "estimate, not a measurement)"
        )
        out += [f"assumes | {line}" for line in sim.assumptions]
        out += [f"stand-in | {line}" for line in sim.stand_ins]
        out.append(
            f"dry run | {sim.wall_s:,.1f} s wall, peak RSS {size(sim.peak_rss_bytes)} (measured on this machine)"
        )
        return out

    def as_dict(self) -> dict[str, Any]:
        sim = self.simulation
        m = sim.measurement
        counts = m.counts
        return {
            "recipe": sim.recipe.name,
            "world_size": sim.layout.world_size,
            "layout": {
                "dp_replicate": sim.layout.dp_replicate,
                "dp_shard": sim.layout.dp_shard,
                "cp": sim.layout.cp,
                "cp_type": sim.recipe.parallel.cp_type,
                "ep": sim.layout.ep,
                "ep_shard": sim.layout.ep_shard,
            },
            "device": sim.device_type,
            "memory": {
                "peak_bytes": m.peak.total_bytes,
                "tracked_peak_bytes": m.peak.peak_bytes,
                "terms_bytes": m.peak.terms,
                "comm_buffers_at_peak_bytes": m.peak.comm_bytes_at_peak,
                "phase_at_peak": m.peak.phase_at_peak,
                "hand_added": [{"term": h.term, "bytes": h.bytes, "why": h.why} for h in m.peak.hand_added],
                "host_bytes_per_rank": sim.host_bytes,
            },
            "flops": {**counts.flops, "total": counts.total_flops, "model": counts.model_flops},
            "ops_without_formula": dict(counts.without_formula),
            "micro_batches": {"run": m.micro_batches_run, "per_step": m.micro_batches_per_step},
            "collectives": [
                {
                    "dim": dim,
                    "op": kind,
                    "overlapped": hidden,
                    "calls": r.calls,
                    "wire_bytes": r.wire_bytes,
                    "network_bytes": r.network_bytes,
                    "payload_bytes": r.payload_bytes,
                    "group_size": len(r.ranks),
                }
                for (dim, kind, hidden), r in sorted(counts.collectives.items())
            ],
            "estimates": [
                {
                    "gpu": e.gpu,
                    "estimate": True,
                    "step_s": e.step_s,
                    "step_eager_s": e.step_eager_s,
                    "step_fused_s": e.step_fused_s,
                    "compute_s": e.compute_s,
                    "compute_eager_s": e.compute_eager_s,
                    "compute_fused_s": e.compute_fused_s,
                    "dominant_ops_s": dict(e.dominant(5)),
                    "overlapped_comm_s": e.overlapped_s,
                    "blocking_comm_s": e.exposed_s,
                    "comm_behind_compute_s": e.comm_overlap_s,
                    "host_link_blocking_s": e.host_exposed_s,
                    "host_link_overlapped_s": e.host_overlapped_s,
                    "host_step_s": e.host_step_s,
                    "comm_s_by_dim": e.comm_s,
                    "mfu": e.mfu,
                    "mfu_fused": e.mfu_fused,
                    "tokens_per_s": sim.tokens_per_step / e.step_s if e.step_s else 0.0,
                    "tokens_per_s_per_gpu": sim.tokens_per_step / e.step_s / sim.layout.world_size if e.step_s else 0.0,
                    "automodel_tflops_per_gpu": self.peer_tflops_per_gpu(e),
                    "fits": f.fits,
                    "host_bytes_per_node": f.host_bytes_per_node,
                    "host_memory_bytes": f.host_memory_bytes,
                    "usable_bytes": f.usable_bytes,
                    "headroom_bytes": f.headroom_bytes,
                    "assumptions": assumptions_line(g),
                }
                for e, f, g in zip(self.estimates, self.fits, self.gpus, strict=True)
            ],
            "automodel_flops": None
            if self.peer_flops is None
            else {
                "formula": self.peer_flops.formula,
                "flops_per_token": self.peer_flops.flops_per_token,
                "row_tokens": self.peer_flops.row_tokens,
            },
            "assumptions": sim.assumptions,
            "stand_ins": sim.stand_ins,
            "dry_run": {"wall_s": sim.wall_s, "peak_rss_bytes": sim.peak_rss_bytes},
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=2, default=str) + "\n")
