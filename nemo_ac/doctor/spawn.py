"""Run a probe on 2 processes (a real 2-rank process group), every variant in one launch.

The doctor's own process stays a single process: it spawns the ranks with ``torch.multiprocessing`` (start method
``spawn``: fresh interpreters, no inherited Dynamo or process-group state), rendezvous through a ``FileStore`` in
a temporary directory, and collects each rank's ``ProbeRun``s from JSON files. Every variant runs in the same
launch because starting two interpreters that import torch costs more than the probe itself.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_ac.doctor.result import ProbeRun

WORLD_SIZE = 2


def _backend_and_device(device: str, rank: int) -> tuple[str, str]:
    if device == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() >= WORLD_SIZE:
        torch.cuda.set_device(rank)
        return "nccl", f"cuda:{rank}"
    return "gloo", "cpu"


def _rank_main(rank: int, target: str, variants: list[dict[str, Any]], device: str, workdir: str) -> None:
    """Entry of each spawned rank: init the group, run every variant, write ``rank<N>.json``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    backend, rank_device = _backend_and_device(device, rank)
    store = dist.FileStore(str(Path(workdir) / "store"), WORLD_SIZE)
    dist.init_process_group(backend, store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    module_name, fn_name = target.rsplit(".", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    runs = []
    try:
        for kwargs in variants:
            run = fn(device=rank_device, **kwargs)
            run.facts["backend"] = backend
            runs.append(run.to_dict())
            dist.barrier()
    finally:
        (Path(workdir) / f"rank{rank}.json").write_text(json.dumps(runs))
        dist.destroy_process_group()


def _merge(per_rank: list[list[dict[str, Any]]], variants: list[dict[str, Any]]) -> list[ProbeRun]:
    """One ProbeRun per variant: ok only if every rank is; rank 0's error unless only another rank failed."""
    merged = []
    for index in range(len(variants)):
        runs = [ProbeRun.from_dict(rank_runs[index]) for rank_runs in per_rank]
        failed = [run for run in runs if not run.ok]
        run = failed[0] if failed else runs[0]
        run.seconds = max(r.seconds for r in runs)
        run.facts["ranks"] = len(runs)
        merged.append(run)
    return merged


class TwoRankLaunch:
    """Starts the 2 ranks at construction; ``results()`` waits for them. The caller can run single-process probes
    meanwhile: the ranks spend most of their time importing torch.

    A launch that crashes or exceeds ``timeout_s`` becomes a failed run for every variant (never an exception,
    never a hang: the spawned ranks are terminated).
    """

    def __init__(self, target: str, variants: list[dict[str, Any]], *, device: str = "cpu", timeout_s: float = 150.0):
        self.variants = variants
        self._workdir = tempfile.TemporaryDirectory(prefix="nemo_ac_doctor_")
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._context = mp.start_processes(
            _rank_main,
            args=(target, variants, device, self._workdir.name),
            nprocs=WORLD_SIZE,
            join=False,
            start_method="spawn",
        )

    def results(self) -> list[ProbeRun]:
        problem = ""
        try:
            while not self._context.join(timeout=1.0):
                if time.monotonic() > self._deadline:
                    problem = f"the 2-process launch did not finish within {self._timeout_s:.0f} s"
                    break
        except Exception as exc:  # a rank died: ProcessRaisedException / ProcessExitedException
            problem = f"a rank failed: {type(exc).__name__}: {str(exc)[-1500:]}"
        finally:
            for process in self._context.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5)
        try:
            return self._collect(problem)
        finally:
            self._workdir.cleanup()

    def _collect(self, problem: str) -> list[ProbeRun]:
        files = [Path(self._workdir.name) / f"rank{rank}.json" for rank in range(WORLD_SIZE)]
        per_rank = [json.loads(f.read_text()) for f in files if f.exists()]
        if problem or len(per_rank) != WORLD_SIZE or any(len(r) != len(self.variants) for r in per_rank):
            problem = problem or "a rank wrote no result"
            return [
                ProbeRun(
                    workaround=bool(kwargs.get("workaround")),
                    ok=False,
                    error_type="LaunchError",
                    error=problem,
                    summary=f"LaunchError: {problem[:400]}",
                )
                for kwargs in self.variants
            ]
        return _merge(per_rank, self.variants)


def run_two_ranks(
    target: str, variants: list[dict[str, Any]], *, device: str = "cpu", timeout_s: float = 150.0
) -> list[ProbeRun]:
    """Run ``target`` (``"module.function"`` returning a ProbeRun) once per kwargs in ``variants`` on 2 ranks."""
    return TwoRankLaunch(target, variants, device=device, timeout_s=timeout_s).results()
