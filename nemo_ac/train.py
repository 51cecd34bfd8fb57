"""Entry point: ``torchrun --nproc-per-node N -m nemo_ac.train RECIPE.yaml [key=value ...]``.

recipe -> validate (before any process group) -> init dist -> build (nemo_ac.trainer.build: meshes -> model on meta ->
parallelize -> materialize -> freeze -> optimizer/data) -> restore -> loop -> export -> summary.

SIGTERM / SIGINT: every rank finishes the current step, step N is saved (checkpoint.enabled), the summary written,
one line printed, exit code 0. A step boundary not reached within ``train.stop_deadline_s`` (a first step still
compiling, weights still loading, a slow save), an error after the signal, or a second signal: rank 0 prints one
line naming where the run was and the checkpoint that stands, and every rank exits 128 + signum
(nemo_ac.trainer.stop).

Errors are printed once: a recipe error by global rank 0 only (every rank finds the same one; the others exit with
the same code, 2, silently); a crash under torchrun as one line by the failing rank, its traceback going to
torchrun's error file (``@record``), which torchrun's failure summary prints as the root cause. Outside torchrun a
crash raises with its traceback as usual.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from nemo_ac.config import ConfigError, RecipeConfig, to_dict, to_yaml
from nemo_ac.config.layout import ParallelLayout
from nemo_ac.diagnostics.compile_caches import CompileCacheCounts, per_rank_report, per_rank_summary
from nemo_ac.diagnostics.compile_progress import CompileProgress
from nemo_ac.diagnostics.recompiles import CompileAccounting
from nemo_ac.models import build_model, model_dtype
from nemo_ac.preflight import preflight
from nemo_ac.runtime import DistEnv, destroy_distributed, exit_process, init_distributed, world_size_from_env
from nemo_ac.trainer.build import build_trainer, build_training
from nemo_ac.trainer.checkpoint.dcp import Checkpointer, TrainingState
from nemo_ac.trainer.checkpoint.files import root_of, step_dir
from nemo_ac.trainer.checkpoint.hf_weights import export_final_hf
from nemo_ac.trainer.flops import device_peak, model_flops_per_token
from nemo_ac.trainer.metric_backends import build_backends
from nemo_ac.trainer.metrics import MetricsLogger, StepMetrics, Throughput
from nemo_ac.trainer.progress import echo
from nemo_ac.trainer.stop import StopSignal, signal_name, standing_checkpoint
from nemo_ac.workarounds.gates import unsupported_torch_note
from nemo_ac.workarounds.rendezvous_shared_store import elastic_restart_hazard


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nemo_ac.train", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.steps=10")
    return parser.parse_args(list(argv))


def load_and_validate(
    recipe_path: str, overrides: Sequence[str], *, world_size: int
) -> tuple[RecipeConfig, ParallelLayout]:
    """Everything that can be wrong with a recipe fails here, before any process group exists: the same
    ``nemo_ac.preflight`` that ``nemo-ac validate --check-env`` runs. Rank 0 prints what loading decided (where
    ``model.pretrained``'s architecture came from, each recipe key overriding its config.json)."""
    checked = preflight(
        recipe_path, overrides, world_size=world_size, check_env=True, cuda_available=torch.cuda.is_available()
    )
    if checked.notes and os.environ.get("RANK", "0") == "0":
        print("\n".join(f"note | {line}" for line in checked.notes), flush=True)
    return checked.recipe, checked.layout


def run(
    recipe: RecipeConfig, layout: ParallelLayout, env: DistEnv, stop: StopSignal | None = None
) -> list[StepMetrics]:
    """Build, restore, train, export, summarize. ``stop`` (installed by ``main``): a SIGTERM / SIGINT ends the
    loop on every rank after the same step, which is then saved (``save_on_signal``), or ends the process at its
    deadline; ``stop.enter`` keeps the phase its line names."""
    watching = stop is not None
    stop = stop if stop is not None else StopSignal()  # not installed: never signalled
    resume_auto = recipe.checkpoint.resume == "auto"
    stop.configure(standing=lambda: standing_checkpoint(root_of(recipe.checkpoint), resume_auto=resume_auto))
    stop.enter("start-up (building the model, loading its weights)")
    setup = build_training(recipe, layout, device=env.device)
    model, plan = setup.model, setup.plan
    # Per-thread compile / recompile / graph-break counts in every step's metrics; warns on eager fallbacks.
    compile_accounting = (
        CompileAccounting(watch_checkpoint_entries=list(plan.applied.compiled_checkpoint_entries)).install()
        if plan.compile is not None
        else None
    )
    # Inductor's FX graph cache hits / misses per rank: which ranks compiled each graph and which loaded it.
    cache_counts = CompileCacheCounts() if plan.compile is not None and plan.compile.backend == "inductor" else None
    if compile_accounting is not None and env.is_main:
        echo(
            f"compile | {plan.compile.backend} | layouts: {', '.join(map(str, plan.compile_layouts()))}"
            + (
                " | one compile per graph per node (compile.node_shared_cache; EP / CP collectives name their group "
                "by its mesh dim)"
                if plan.compile.node_shared()
                else ""
            )
        )
    throughput = measure_throughput_basis(recipe, layout, env)  # every rank: the CPU probe runs under contention
    if env.is_main:
        Path(recipe.logging.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(recipe.logging.run_dir) / "recipe.yaml").write_text(to_yaml(recipe))
        echo(
            f"nemo_ac | {recipe.name} | world {layout.world_size} = dp_replicate {layout.dp_replicate} x dp_shard "
            f"{layout.dp_shard} x cp {layout.cp} (ep {layout.ep}) | {env.backend} on {env.device} | "
            f"params {sum(p.numel() for p in model.parameters()):,} ({setup.weights})"
            + "".join(f" | frozen {group} {count:,}" for group, count in setup.frozen.items() if count)
        )
        if (torch_note := unsupported_torch_note()) is not None:
            echo(torch_note)
        echo("\n".join(plan.summary_lines()))  # the kernels line first
        echo(throughput_line(throughput))
    checkpointer = Checkpointer(
        config=recipe.checkpoint, total_steps=recipe.train.steps, recipe=to_dict(recipe), device=env.device
    )
    state = TrainingState(model=model, optimizer=setup.optimizer, scheduler=setup.scheduler, data=setup.data)
    stop.enter("start-up (restoring the checkpoint)")
    resumed_step = checkpointer.restore(state)
    logger = MetricsLogger(
        resumed_from_step=resumed_step,
        run_dir=recipe.logging.run_dir,
        total_steps=recipe.train.steps,
        enabled=env.is_main,
        jsonl=recipe.logging.jsonl,
        progress_bar=recipe.logging.progress_bar,
        log_every=recipe.logging.log_every,
        throughput=throughput,
        backends=build_backends(
            recipe.logging, run_name=recipe.name, recipe=to_dict(recipe), resumed_from_step=resumed_step
        )
        if env.is_main
        else (),
    )
    metric_sources = compile_accounting.metric_sources() if compile_accounting else {}
    offloader = plan.applied.offloader  # activation_checkpointing.offload: tensors / MiB moved to host memory
    if offloader is not None:
        metric_sources.update(offloader.metric_sources())
    trainer = build_trainer(setup, logger=logger, metric_sources=metric_sources)
    trainer.step = resumed_step
    compile_progress = None
    if plan.compile is not None and env.is_main and resumed_step < recipe.train.steps:
        echo(
            "compile | the first step compiles every block layout (forward, then backward): minutes on CPU with a "
            "cold inductor cache, seconds once TORCHINDUCTOR_CACHE_DIR holds it (README 'First run')"
        )
        compile_progress = CompileProgress(echo).install()
        stop.configure(phase_detail=lambda: " (compiling)" if compile_progress.compiling() else "")

    def step_end(step: int) -> None:
        if checkpointer.should_save(step):
            stop.enter(f"the checkpoint save of step {step}")
        checkpointer.on_step_end(step, state)

    logger.start_progress()
    try:
        history = trainer.fit(
            on_step_end=step_end,
            should_stop=(lambda: stop.agreed(env.device)) if watching else None,
            on_step_start=lambda step: stop.enter(f"step {step}"),
        )
    except BaseException:
        logger.close()  # end the bar's line: the error report must not start on it
        raise
    finally:
        if compile_progress is not None:
            compile_progress.close()
    if stop.signum:
        stop.enter(f"the checkpoint save of step {trainer.step}")
        message = save_on_signal(
            recipe,
            signum=stop.signum,
            step=trainer.step,
            resumed_step=resumed_step,
            checkpointer=checkpointer,
            state=state,
        )
        logger.event("stop", signal=signal_name(stop.signum), at_step=trainer.step)
        logger.summary({"resumed_from_step": resumed_step, "stopped_by": signal_name(stop.signum)})
        stop.finish(message if env.is_main else None, write=lambda line: echo(line, file=sys.stderr))
        return history
    if recipe.checkpoint.export_hf:
        stop.enter("the Hugging Face export")
        exported = export_final_hf(model, config=recipe.checkpoint, recipe=recipe)
        if env.is_main:
            echo(f"export | Hugging Face checkpoint at step {trainer.step}: {exported}")
    summary_extra = {"resumed_from_step": resumed_step} if resumed_step else {}
    if compile_accounting is not None:
        compile_accounting.close()
        summary_extra.update(compile_accounting.summary())
    per_rank_caches = gather_per_rank(cache_counts.counts()) if cache_counts is not None else None
    if per_rank_caches is not None:
        summary_extra.update(per_rank_summary(per_rank_caches))
    stop.enter("the run's summary")
    logger.summary(summary_extra or None)
    if compile_accounting is not None and env.is_main:
        echo(compile_accounting.report())
    if per_rank_caches is not None and env.is_main:
        echo(per_rank_report(per_rank_caches))
    if stop.received:  # during the last step or after it: the run completed; its last step is saved as usual
        saved = (
            "checkpoint.enabled=false" if not recipe.checkpoint.enabled else step_dir(checkpointer.root, trainer.step)
        )
        line = f"nemo_ac: {signal_name(stop.received)} after the last step began: the run completed ({saved}); exiting"
        stop.finish(line if env.is_main else None, write=lambda text: echo(text, file=sys.stderr))
    return history


def gather_per_rank(value: dict[str, int]) -> list[dict[str, int]]:
    """``value`` of every rank, by rank (every rank calls it; without a process group: this rank's alone)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [value]
    gathered: list[dict[str, int]] = [{} for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def measure_throughput_basis(recipe: RecipeConfig, layout: ParallelLayout, env: DistEnv) -> Throughput:
    """Model FLOPs per token (from the model on meta: parallelization shards the experts) and the device's peak
    (a datasheet number on GPU, a matmul probe on CPU) for tokens/s per rank and MFU (nemo_ac.trainer.flops)."""
    flops = model_flops_per_token(build_model(recipe.model, device="meta"), recipe)
    peak, reason = device_peak(env.device, model_dtype(recipe.parallel.fsdp.param_dtype))
    if peak is None:
        return Throughput(world_size=layout.world_size, flops_per_token=flops, peak_source=reason)
    return Throughput(layout.world_size, flops, peak.flops, peak.source)


def throughput_line(throughput: Throughput) -> str:
    if throughput.peak_flops is None:
        return f"flops | {throughput.flops_per_token / 1e6:,.2f} MFLOP per token | {throughput.peak_source}"
    return (
        f"flops | {throughput.flops_per_token / 1e6:,.2f} MFLOP per token | peak {throughput.peak_flops / 1e12:,.3f} "
        f"TFLOP/s per rank ({throughput.peak_source}) for mfu"
    )


def save_on_signal(
    recipe: RecipeConfig,
    *,
    signum: int,
    step: int,
    resumed_step: int,
    checkpointer: Checkpointer,
    state: TrainingState,
) -> str:
    """Save step ``step`` after a signal stopped the loop (unless it is saved already, or checkpointing is off)
    and return the one line the run ends with."""
    head = f"nemo_ac: {signal_name(signum)} at step {step}"
    if not recipe.checkpoint.enabled:
        return f"{head}: checkpointing is off (checkpoint.enabled=false), nothing saved; exiting"
    if step == resumed_step:
        return f"{head}: no step finished since the start, nothing new to save; exiting"
    path = step_dir(checkpointer.root, step) if checkpointer.should_save(step) else checkpointer.save(step, state)
    how = "rerun the same command" if recipe.checkpoint.resume == "auto" else "resume with checkpoint.resume=auto"
    return f"{head}: checkpoint saved to {path}; {how} to continue"


MAX_ERROR_CHARS = 600  # of the one-line crash report; the error file has the whole message and traceback


def one_line(exc: BaseException, *, limit: int) -> str:
    """``exc``'s message on one line, cut at ``limit`` characters."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rank() -> str:
    return os.environ.get("RANK", "0")


def report_config_error(exc: ConfigError, *, quiet_wait_s: float = 5.0) -> None:
    """Print a recipe error once. Every rank validates the same recipe and finds the same problems, so rank 0
    reports and the others wait ``quiet_wait_s`` in silence: torchrun, seeing rank 0 exit, ends them (SIGTERM) before
    they print. A rank still alive after the wait found a problem rank 0 did not (a missing package on its node)
    and reports it itself."""
    if _rank() != "0":
        time.sleep(quiet_wait_s)
    print(f"nemo_ac: {exc}", file=sys.stderr, flush=True)


@record  # under torchrun: a crash's traceback goes to the error file, which torchrun's summary prints
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        recipe, layout = load_and_validate(args.recipe, args.overrides, world_size=world_size_from_env())
    except ConfigError as exc:
        report_config_error(exc)
        return 2
    hazard = elastic_restart_hazard()
    if hazard and _rank() == "0":
        print(f"nemo_ac WARNING: {hazard}", file=sys.stderr, flush=True)
    # Before the process group: a signal during start-up stops before step 1, or at the deadline.
    stop = StopSignal(deadline_s=recipe.train.stop_deadline_s).install()
    env = init_distributed(recipe.dist, host_collectives=recipe.train.optimizer_offload == "full")
    try:
        run(recipe, layout, env, stop)
    except BaseException as exc:
        if stop.received:  # a consequence of the stop (compile workers or a peer gone): the stop's one line, no crash
            stop.exit_now(stop.received, reason=f"the run ended with {type(exc).__name__}: {one_line(exc, limit=200)}")
        destroy_distributed(synchronize=False)
        raise
    destroy_distributed()
    return 0  # also after a SIGTERM / SIGINT stop, whose state is saved (nemo_ac.trainer.stop says why)


def entry() -> int:
    """``main`` with a crash under torchrun reported as one line on the failing rank: ``@record`` has written the
    traceback to ``TORCHELASTIC_ERROR_FILE`` and torchrun prints it in its failure summary, so repeating it here on
    every failing rank would only bury it. Without torchrun (no error file) the exception propagates."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    try:
        return main()
    except Exception as exc:
        if not error_file:
            raise
        text = one_line(exc, limit=MAX_ERROR_CHARS)  # a listed error: one line
        print(
            f"nemo_ac: rank {_rank()} failed: {type(exc).__name__}: {text} (traceback: torchrun's summary, {error_file})",
            file=sys.stderr,
            flush=True,
        )
        return 1


if __name__ == "__main__":
    exit_process(entry())
