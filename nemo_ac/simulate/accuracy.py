"""A dry run held against a measured step of the same recipe (``nemo_ac.simulate.measure``'s ``rank<r>.json``).

``nemo-ac plan RECIPE --against DIR`` prints it; the accuracy tests assert it on ``ACCURACY_CASES``. What is compared, for one rank:
the tracked peak memory (the same tracker in fake and in real mode), the FLOPs per phase and their total against
``FlopCounterMode`` over the real step, and every collective's calls and bytes per mesh dimension and op. Where the
step was measured on a GPU with ``--profile``, the estimate's compute is held against the kernels' time torch's
profiler saw, op by op (``profile_lines``): a step the host bounds is no test of a kernel-time estimate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_ac.simulate.estimate import StepEstimate
from nemo_ac.simulate.measure import counts_as_dict
from nemo_ac.simulate.run import Simulation

# The accuracy check's cases (tests/functional/test_plan_accuracy.py, benchmarks/plan_accuracy.py): name -> (recipe
# under recipes/, ranks, overrides). Both sides route as the dry run assumes and do not compile, but for the compiled
# case: its blocks compile (aot_eager: Dynamo's frames without inductor's minutes on CPU) before the counted step,
# which runs them under the counters as their eager op stream, what the dry run counts (measure.compile_before_counting).
ACCURACY_OVERRIDES = ("dist.device=cpu", "model.moe.force_balanced_routing=true", "compile.enabled=false")
ACCURACY_CASES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "qwen3_moe_tiny": ("tiny/qwen3_moe_tiny.yaml", 2, ()),
    "glm_4_5_air_tiny": ("tiny/glm_4_5_air_tiny.yaml", 2, ()),
    "nemotron_super_v3_tiny": ("tiny/nemotron_super_v3_tiny.yaml", 2, ()),
    "qwen3_6_medpix_tiny": ("tiny/qwen3_6_medpix_tiny.yaml", 4, ()),
    "qwen3_moe_tiny_hsdp_2x2": ("tiny/qwen3_moe_tiny.yaml", 4, ("parallel.dp_replicate=2", "parallel.dp_shard=2")),
    "qwen3_moe_tiny_ring_cp2": ("tiny/qwen3_moe_tiny.yaml", 2, ("parallel.cp=2", "parallel.cp_type=ring")),
    # The tiny GLM recipe keeps FSDP's shards on the host (optimizer_offload full); here only AdamW's states.
    "glm_4_5_air_tiny_states": ("tiny/glm_4_5_air_tiny.yaml", 2, ("train.optimizer_offload=states",)),
    "qwen3_moe_tiny_compiled": ("tiny/qwen3_moe_tiny.yaml", 2, ("compile.enabled=true", "compile.backend=aot_eager")),
    # bf16 masters and moments (train.master_dtype): the shards, gradients and states FSDP and AdamWLowPrecision hold.
    "qwen3_moe_tiny_bf16_masters": (
        "tiny/qwen3_moe_tiny.yaml",
        2,
        ("parallel.fsdp.param_dtype=bfloat16", "train.master_dtype=bfloat16", "train.optimizer_state_dtype=bfloat16"),
    ),
    # fp8 moments: e4m3 codes and fp32 block scales (trainer/adamw_fp8_states.py), the update's temporaries eager.
    "qwen3_moe_tiny_fp8_states": ("tiny/qwen3_moe_tiny.yaml", 2, ("train.optimizer_state_dtype=float8",)),
}


@dataclass(frozen=True)
class Comparison:
    rank: int
    predicted_peak: int
    measured_peak: int
    predicted_flops: int
    measured_flops: int  # StepCounter over the real step
    flop_counter_flops: int  # torch's FlopCounterMode over the real step
    collectives_equal: bool
    collective_differences: tuple[str, ...]
    predicted_host: dict[str, int] = field(default_factory=dict)  # host memory per rank by term (memory.host_bytes)
    measured_host: dict[str, int] = field(default_factory=dict)

    @property
    def peak_ratio(self) -> float:
        return self.predicted_peak / self.measured_peak if self.measured_peak else float("nan")

    @property
    def flops_ratio(self) -> float:
        return self.predicted_flops / self.flop_counter_flops if self.flop_counter_flops else float("nan")

    def line(self) -> str:
        return (
            f"against | rank {self.rank}: peak {self.predicted_peak:,} B predicted / {self.measured_peak:,} B measured "
            f"= {self.peak_ratio:.4f} | FLOPs {self.predicted_flops:,} / FlopCounterMode {self.flop_counter_flops:,} "
            f"= {self.flops_ratio:.4f} | collectives "
            + ("equal" if self.collectives_equal else "DIFFER: " + "; ".join(self.collective_differences))
            + (
                f" | host {sum(self.predicted_host.values()):,} B predicted / {sum(self.measured_host.values()):,} B "
                "measured"
                if self.predicted_host or self.measured_host
                else ""
            )
        )


def read_measured(directory: str | Path, rank: int) -> dict[str, Any]:
    return json.loads((Path(directory) / f"rank{rank}.json").read_text())


def compare(simulation: Simulation, measured: dict[str, Any]) -> Comparison:
    """``simulation`` (one rank, every micro batch run) against that rank's measured step."""
    predicted = counts_as_dict(simulation.measurement.counts)
    differences = []
    for key in sorted(set(predicted["collectives"]) | set(measured["collectives"])):
        mine, theirs = predicted["collectives"].get(key), measured["collectives"].get(key)
        if mine != theirs:
            differences.append(f"{key}: predicted {mine}, measured {theirs}")
    return Comparison(
        rank=int(measured["rank"]),
        predicted_peak=simulation.measurement.peak.peak_bytes,
        measured_peak=int(measured["peak_bytes"]),
        predicted_flops=sum(predicted["flops"].values()),
        measured_flops=sum(measured["flops"].values()),
        flop_counter_flops=int(measured["flop_counter_total"]),
        collectives_equal=not differences,
        collective_differences=tuple(differences),
        predicted_host=dict(simulation.host_bytes),
        measured_host={k: int(v) for k, v in measured.get("host_bytes", {}).items()},
    )


# Below this share of the profiled step's wall time in kernels, the host (Python, dispatch, launches) bounds the step.
HOST_BOUND_SHARE = 0.5


def profile_lines(profile: dict[str, Any], estimate: StepEstimate, *, rows: int = 8) -> list[str]:
    """The estimate held against torch's profiler over one measured GPU step (``measure --profile``): whether the
    kernels or the host bound the step, the estimate's compute against the kernels' busy time, and the ops that
    took the most device time beside the estimate's seconds for the op of that name (``-``: none it costs by that
    name, such as a compiled region's kernels). Empty for a CPU measurement: the estimate is for a GPU's kernels."""
    if profile.get("device_type") != "cuda" or not profile.get("device_busy_s"):
        return []
    busy, wall, host = profile["device_busy_s"], profile["wall_s"], profile["host_s"]
    verdict = (
        f"host-bound: kernels ran {busy / wall:.0%} of it"
        if busy < HOST_BOUND_SHARE * wall
        else f"kernels ran {busy / wall:.0%} of it"
    )
    lines = [
        f"against | profiled step {wall:.3f} s wall (torch profiler, one step after the timed ones): kernels "
        f"{busy:.3f} s, host-side ops {host:.3f} s; {verdict}. The estimate's compute {estimate.compute_s:.3f} s is "
        f"{estimate.compute_s / busy - 1:+.1%} against the kernels' time"
    ]
    ops = sorted(profile["ops"].items(), key=lambda item: -item[1]["self_device_s"])
    for name, op in ops[:rows]:
        estimated = estimate.by_op.get(name.split("::", 1)[-1])
        lines.append(
            f"against |   {name[:44]:<44} measured {op['self_device_s'] * 1e3:9.2f} ms ({op['calls']} calls) | "
            + (f"estimated {estimated * 1e3:9.2f} ms" if estimated is not None else "estimated         -")
        )
    return lines


def step_time_line(measured: dict[str, Any], estimate: StepEstimate) -> str | None:
    """The measured step time (median of the timed steps) beside the estimate, with the estimate's error where the
    step ran on the GPU the estimate is for; elsewhere (a CPU step, another GPU) no error, and the line says why: an
    H100 estimate against a CPU step would read -100%. None without timed steps."""
    from nemo_ac.simulate.gpus import spec_for_device_name

    walls = sorted(measured.get("step_wall_s") or [])
    if not walls:
        return None
    median = walls[len(walls) // 2]
    ran_on = measured.get("gpu_name") or measured.get("device") or "an unknown device"
    spec = spec_for_device_name(measured["gpu_name"]) if measured.get("gpu_name") else None
    if spec is not None and spec.name == estimate.gpu:
        verdict = f"error {estimate.step_s / median - 1:+.1%}"
    else:
        verdict = f"no error printed: measured on {ran_on}, estimated for {estimate.gpu}"
    return (
        f"against | step measured {median:.3f} s (median of {len(walls)}) on {ran_on}; estimated "
        f"{estimate.step_s:.3f} s on {estimate.gpu} (bounds {estimate.step_fused_s:.3f} .. {estimate.step_eager_s:.3f} "
        f"s); {verdict}"
    )
