"""``nemo-ac doctor``: run every probe with and without its workaround on the installed torch, then judge.

Single process (a gloo world-size-1 group, or NCCL on ``--device cuda``) for every probe except the explicit
prefetch one, which needs 2 ranks: the doctor spawns them first and runs the others while they start.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nemo_ac.doctor.args import add_doctor_arguments
from nemo_ac.doctor.checks import run_checks
from nemo_ac.doctor.report import DoctorReport, render_table
from nemo_ac.doctor.result import ProbeRun, judge
from nemo_ac.doctor.spawn import TwoRankLaunch
from nemo_ac.workarounds.registry import workaround as registry_row


@dataclass(frozen=True)
class ProbeSpec:
    """One row: ``target`` is ``"module.function(*, workaround, device[, torch_version]) -> ProbeRun"``; ``fix``
    names the ``nemo_ac.workarounds`` registry row it tests (its gate and its compat entry point)."""

    name: str
    title: str
    fix: str
    target: str
    version_gated: bool  # the target takes torch_version (the gate is applied inside the run)
    processes: int = 1

    @property
    def workaround(self) -> str:
        """What another trainer calls (the registry row's compat entry, first part), or for a fix internal to
        nemo_ac the module that holds it."""
        row = registry_row(self.fix)
        return row.compat.split(" + ")[0].split(" / ")[0] if row.compat else f"workarounds.{row.name}"

    def gate(self, torch_version: str | None) -> bool:
        """Does nemo_ac enable the workaround on this torch version?"""
        return registry_row(self.fix).active(torch_version=torch_version)


PROBES: tuple[ProbeSpec, ...] = (
    ProbeSpec(
        "upstream_profiler_ignore",
        "torch's SAC ignores FSDP2's profiler ops",
        "profiler_ops_in_sac",
        "nemo_ac.doctor.probes_upstream.run_upstream_profiler_check",
        version_gated=True,
    ),
    ProbeSpec(
        "sac_profiler_ops",
        "SAC desync from FSDP2 record_function ops (nested unit in a SAC region)",
        "profiler_ops_in_sac",
        "nemo_ac.doctor.probes_sac.run_profiler_ops_probe",
        version_gated=True,
    ),
    ProbeSpec(
        "sac_fsdp_prefetch",
        "SAC desync from FSDP2 all-gather under explicit prefetch (2 processes)",
        "fsdp_hooks_in_sac",
        "nemo_ac.doctor.probes_sac.run_fsdp_prefetch_rank",
        version_gated=True,
        processes=2,
    ),
    ProbeSpec(
        "thread_config",
        "recompute on the backward thread sees the forward's Dynamo config",
        "forward_thread_compile_config",
        "nemo_ac.doctor.probes_thread.run_thread_config_probe",
        version_gated=False,
    ),
    ProbeSpec(
        "recompute_thread",
        "AC(compile(block)) recompute compiling on another thread",
        "forward_thread_compile_config",
        "nemo_ac.doctor.probes_thread.run_recompute_thread_probe",
        version_gated=False,
    ),
    # After the compiling probes above: Dynamo and AOTAutograd are warm, these cost well under a second each.
    ProbeSpec(
        "sac_compiled_regions",
        "SAC caches buffers that inductor's code reuses (a stand-in region, no compile)",
        "compiled_regions_under_sac",
        "nemo_ac.doctor.probes_regions.run_compiled_regions_probe",
        version_gated=False,
    ),
    ProbeSpec(
        "dynamic_ints",
        "per-micro-batch ints specialized by Dynamo's first compile (backend eager)",
        "dynamic_per_batch_ints",
        "nemo_ac.doctor.probes_compile.run_dynamic_ints_probe",
        version_gated=False,
    ),
    ProbeSpec(
        "grouped_mm_fake",
        "aten._grouped_mm's fake rule in the experts' dtypes",
        "grouped_mm_fake_rule",
        "nemo_ac.doctor.probes_kernels.run_grouped_mm_fake_probe",
        version_gated=False,
    ),
    ProbeSpec(
        "softplus_layout",
        "compiled softplus backward with a transposed gradient (backend aot_eager)",
        "softplus_backward_layout",
        "nemo_ac.doctor.probes_compile.run_softplus_layout_probe",
        version_gated=False,
    ),
    ProbeSpec(
        "rendezvous_restart",
        "a torchrun restart's rendezvous hands back the killed attempt's store",
        "rendezvous_shared_store",
        "nemo_ac.doctor.probes_launch.run_rendezvous_probe",
        version_gated=False,
    ),
)
NOTES = {
    "sac_fsdp_prefetch": "with the profiler ops ignored in both runs; the workaround needs the modes of "
    "compat.selective_checkpoint_context_fn (torch's own SAC modes do not honour it)",
    "sac_compiled_regions": "the recompute runs a recompiled region, as after a cache miss on another thread",
}


def _call(spec: ProbeSpec, *, workaround: bool, device: str, torch_version: str | None) -> ProbeRun:
    module_name, fn_name = spec.target.rsplit(".", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    kwargs: dict[str, Any] = {"workaround": workaround, "device": device}
    if spec.version_gated:
        kwargs["torch_version"] = torch_version
    return fn(**kwargs)


def _kwargs(spec: ProbeSpec, *, workaround: bool, torch_version: str | None) -> dict[str, Any]:
    return {"workaround": workaround, **({"torch_version": torch_version} if spec.version_gated else {})}


@contextmanager
def _world_of_one(device: str):
    """A world-size-1 process group for the single-process probes (gloo on CPU, NCCL on CUDA)."""
    if dist.is_initialized():
        raise RuntimeError("nemo-ac doctor needs a process of its own: a process group is already initialized")
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_doctor(
    *, device: str = "cpu", only: Sequence[str] | None = None, torch_version: str | None = None
) -> DoctorReport:
    """Run the selected probes (default: all) off and on, and without ``only`` the checks of the private torch
    techniques (``doctor.checks``); ``torch_version`` decides nemo_ac's gates as if that torch were running (to see
    what an older build would get), the probes still run on the installed torch.

    Call it from a process without a process group; the 2-process probe spawns fresh interpreters, so a calling
    script needs the usual ``if __name__ == "__main__":`` guard (``nemo-ac doctor`` has it).
    """
    start = time.perf_counter()
    selected = [spec for spec in PROBES if only is None or spec.name in only]
    report = DoctorReport(torch_version=torch.__version__, assumed_torch_version=torch_version, device=device)
    launches = {
        spec.name: TwoRankLaunch(
            spec.target,
            [_kwargs(spec, workaround=w, torch_version=torch_version) for w in (False, True)],
            device=device,
        )
        for spec in selected
        if spec.processes == 2
    }
    runs: dict[str, tuple[ProbeRun, ProbeRun]] = {}
    with _world_of_one(device):
        for spec in selected:
            if spec.processes == 1:
                runs[spec.name] = tuple(
                    _call(spec, workaround=w, device=device, torch_version=torch_version) for w in (False, True)
                )
        if only is None:
            report.checks = run_checks()
    for name, launch in launches.items():
        runs[name] = tuple(launch.results())
    for spec in selected:
        off, on = runs[spec.name]
        report.verdicts.append(
            judge(
                name=spec.name,
                title=spec.title,
                workaround=spec.workaround,
                workaround_active=spec.gate(torch_version),
                off=off,
                on=on,
                note=NOTES.get(spec.name, ""),
            )
        )
    report.seconds = time.perf_counter() - start
    return report


def doctor_main(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("nemo-ac doctor: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    report = run_doctor(device=args.device, only=args.only, torch_version=args.assume_torch_version)
    print(report.to_json() if args.json else render_table(report))
    return report.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_doctor_arguments(argparse.ArgumentParser(prog="nemo-ac doctor"))
    return doctor_main(parser.parse_args(argv))
