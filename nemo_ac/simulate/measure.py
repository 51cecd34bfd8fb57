"""The dry run's measurement twin: one real training step counted the same way, to check a plan against.

    torchrun --nproc-per-node N -m nemo_ac.simulate.measure RECIPE --out DIR [key=value ...]

Every rank builds the run exactly as ``nemo_ac.train`` does (real process group, real weights), starts like a later
step (``start_like_a_later_step``), then runs one step of ``Trainer.accumulate`` / ``update`` over all of its micro
batches of step 1 under the same counters as ``nemo-ac plan`` (``StepCounter`` and the memory tracker), the same
micro batches once more under torch's ``FlopCounterMode`` alone, and writes ``DIR/rank<r>.json``. Then it times ``--timed-steps`` more steps
without any counter (wall clock, synchronized on CUDA), the number an estimated step time is compared with.

The accuracy tests run it on gloo beside ``simulate`` on the same recipe (``tests/functional/test_plan_accuracy.py``);
``benchmarks/gpu_check.sh`` runs it on a GPU beside ``nemo-ac plan``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from nemo_ac.config.layout import ParallelLayout
from nemo_ac.config.schema import RecipeConfig
from nemo_ac.diagnostics.recompiles import CompileAccounting
from nemo_ac.preflight import preflight
from nemo_ac.runtime import DistEnv, destroy_distributed, exit_process, init_distributed, world_size_from_env
from nemo_ac.simulate.counters import StepCounter, StepCounts
from nemo_ac.simulate.memory import PeakSampler, host_bytes
from nemo_ac.simulate.run import mesh_group_labels
from nemo_ac.simulate.step import measure_step, start_like_a_later_step
from nemo_ac.trainer.build import build_trainer, build_training, quiet_logger
from nemo_ac.trainer.loop import Trainer
from nemo_ac.workarounds.fake_world import dtensor_propagation_marked


def counts_as_dict(counts: StepCounts) -> dict[str, Any]:
    """The counts both sides of an accuracy check compare (JSON-able)."""
    return {
        "flops": dict(counts.flops),
        "without_formula": dict(counts.without_formula),
        "collectives": {
            f"{dim}|{kind}|{int(hidden)}": {
                "calls": r.calls,
                "wire_bytes": r.wire_bytes,
                "payload_bytes": r.payload_bytes,
            }
            for (dim, kind, hidden), r in sorted(counts.collectives.items())
        },
    }


def measure(
    recipe_path: str, overrides: Sequence[str], *, out: Path, timed_steps: int, profile: bool = False
) -> dict[str, Any]:
    """Preflight, process group, ``measure_step_of``, teardown (the command)."""
    checked = preflight(recipe_path, overrides, world_size=world_size_from_env(), check_env=True)
    env = init_distributed(checked.recipe.dist, host_collectives=checked.recipe.train.optimizer_offload == "full")
    try:
        return measure_step_of(
            checked.recipe, checked.layout, env=env, out=out, timed_steps=timed_steps, profile=profile
        )
    finally:
        destroy_distributed()


def measure_step_of(
    recipe: RecipeConfig,
    layout: ParallelLayout,
    *,
    env: DistEnv,
    out: Path,
    timed_steps: int = 0,
    profile: bool = False,
) -> dict[str, Any]:
    """One counted step of ``recipe`` in the process group that is up (module docstring); writes this rank's JSON.
    Several recipes may be measured in turn in one process group (the accuracy tests do). With ``profile``, one more
    step after the timed ones runs under torch's profiler (its wall time is not among the timed ones): what dominates a
    measured step that the estimate misses."""
    setup = build_training(recipe, layout, device=env.device)
    trainer = build_trainer(setup, logger=quiet_logger(setup.recipe))
    prepared = [trainer.prepare_batch(b.to(env.device)) for b in setup.data.batches_for_step(0)]
    tokens = trainer.global_tokens(prepared)
    # Closed however the step ends: measurements of several recipes share one process (the accuracy tests), and
    # a failed one must not leave its compile callbacks counting the next recipe's compiles.
    with CompileAccounting(watch_checkpoint_entries=setup.plan.applied.compiled_checkpoint_entries) as accounting:
        if setup.plan.compile is not None:
            compile_before_counting(trainer, prepared, global_tokens=tokens)
        hold = len(prepared) > 1 and not trainer.options.reduce_grads_on_last_micro_batch_only
        start_like_a_later_step(trainer, hold_gradients=hold)
        counter = StepCounter(group_labels=mesh_group_labels(setup.meshes))
        sampler = PeakSampler(setup.model, setup.optimizer, device_type=env.device.type, context=counter.buffer_state)
        with dtensor_propagation_marked(), sampler, counter:
            measured = measure_step(
                trainer, prepared, global_tokens=tokens, counter=counter, sampler=sampler, micro_batch_limit=None
            )
        host = host_bytes(
            setup.optimizer,
            setup.plan.applied.offloader,
            measured.micro_batches_run,
            model=setup.model,
            parameters_on_host=setup.plan.fsdp.parameters_on_host,
        )
        # torch's own count over the same micro batches, in a pass of its own: FlopCounterMode keeps tensors alive
        # longer (its module hooks), which moved the tracked peak of the tiny Qwen3 MoE step from 3.1 to 7.2 MB.
        with dtensor_propagation_marked(), FlopCounterMode(display=False) as flop_counter:
            trainer.accumulate(prepared, global_tokens=tokens)
            trainer.update()
        walls = []
        profiled: dict[str, Any] = {}
        for step in range(1, timed_steps + 1 + int(profile)):
            batches = [trainer.prepare_batch(b.to(env.device)) for b in setup.data.batches_for_step(step)]
            step_tokens = trainer.global_tokens(batches)
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            with step_profiler(
                enabled=step > timed_steps, device_type=env.device.type, out=out, rank=env.rank
            ) as profiled_step:
                started = time.perf_counter()
                trainer.accumulate(batches, global_tokens=step_tokens)
                trainer.update()
                if env.device.type == "cuda":
                    torch.cuda.synchronize(env.device)
                elapsed = time.perf_counter() - started
            if step <= timed_steps:
                walls.append(elapsed)
            else:
                profiled = {**profiled_step, "wall_s": elapsed}
        result = {
            "recipe": recipe.name,
            "rank": env.rank,
            "world_size": env.world_size,
            "device": str(env.device),
            # the GPU it ran on (torch's name): nemo-ac plan --against prints the estimate's error only for that GPU
            "gpu_name": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None,
            "peak_bytes": measured.peak.peak_bytes,
            "terms": measured.peak.terms,
            "phase_at_peak": measured.peak.phase_at_peak,
            "host_bytes": host,
            "flop_counter_total": int(flop_counter.get_total_flops()),
            "micro_batches": measured.micro_batches_per_step,
            "step_wall_s": walls,
            "compile": accounting.metrics(),  # the timed steps ran compiled blocks where compiles_fwd > 0
            "profile": profiled,  # {} without --profile; step_profiler's summary, wall_s under the profiler
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(env.device)
            if env.device.type == "cuda"
            else None,
            **counts_as_dict(measured.counts),
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{env.rank}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def compile_before_counting(trainer: Trainer, prepared: Sequence[Any], *, global_tokens: int) -> None:
    """One plain step first, so that the compiled blocks compile before any counter runs them.

    Dynamo compiles nothing whose first call runs under a dispatch mode (the counters are ``TorchDispatchMode``s),
    and the frame stays uncompiled on later calls without one: a ``compile.enabled=true`` measurement timed an eager
    step (0 frames compiled, on CPU and on an H200). Once compiled, a block called under the counters runs its
    eager op stream (what the dry run counts) and the timed steps run the compiled code. The step changes weights
    and optimizer state only: the counted step's shapes, FLOPs and peak are those of any later step."""
    trainer.accumulate(prepared, global_tokens=global_tokens)
    trainer.update()


@contextlib.contextmanager
def step_profiler(*, enabled: bool, device_type: str, out: Path, rank: int, rows: int = 25) -> Iterator[dict[str, Any]]:
    """torch's profiler around one step: the ops by their own device time (CPU time on CPU), printed as ``profile |``
    lines and written to ``DIR/profile_rank<r>.txt``. The table is torch's ``key_averages``; nothing is re-counted.

    Yields a dict filled on exit (JSON-able): per op (the host-side rows: each kernel's time belongs to the op that
    launched it) its calls, self device seconds and self CPU seconds, and their sums, ``device_busy_s`` (kernels of
    overlapping streams counted each) and ``host_s``: what ``nemo-ac plan --against`` holds the estimate's ops
    against, and whether the host or the device bounds the step."""
    summary: dict[str, Any] = {}
    if not enabled:
        yield summary
        return
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        yield summary
    averages = prof.key_averages()
    ops = {
        event.key: {
            "calls": int(event.count),
            "self_device_s": float(getattr(event, "self_device_time_total", 0.0)) / 1e6,
            "self_cpu_s": float(event.self_cpu_time_total) / 1e6,
        }
        for event in averages
        if event.device_type == DeviceType.CPU
    }
    summary.update(
        device_type=device_type,
        device_busy_s=sum(op["self_device_s"] for op in ops.values()),
        host_s=sum(op["self_cpu_s"] for op in ops.values()),
        ops=ops,
    )
    sort_by = "self_cuda_time_total" if device_type == "cuda" else "self_cpu_time_total"
    table = averages.table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_rank{rank}.txt").write_text(table + "\n")
    if rank == 0:
        for line in table.splitlines():
            print(f"profile | {line}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nemo_ac.simulate.measure", description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--timed-steps", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="one more step under torch's profiler: its top ops")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    unknown = [item for item in overrides if item.startswith("-") or "=" not in item]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (overrides look like section.key=value)")
    measure(args.recipe, overrides, out=args.out, timed_steps=args.timed_steps, profile=args.profile)
    return 0


if __name__ == "__main__":
    exit_process(main())
