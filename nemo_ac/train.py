"""Entry point: ``torchrun --nproc-per-node N -m nemo_ac.train RECIPE.yaml [key=value ...]``.

recipe -> validate (before any process group) -> init dist -> build (nemo_ac.trainer.build: meshes -> model on meta ->
parallelize -> materialize -> freeze -> optimizer/data) -> restore -> loop -> export -> summary.

SIGTERM / SIGINT: every rank finishes the current step, step N is saved (checkpoint.enabled), the summary written,
one line printed, exit code 0; a second signal exits at once with 128 + signum (nemo_ac.trainer.stop).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from nemo_ac.config import ConfigError, RecipeConfig, check_environment, load_recipe, to_dict, to_yaml, validate_recipe
from nemo_ac.config.validate import ParallelLayout
from nemo_ac.diagnostics.recompiles import CompileAccounting
from nemo_ac.distributed.env import DistEnv, destroy_distributed, exit_process, init_distributed, world_size_from_env
from nemo_ac.trainer.build import build_trainer, build_training
from nemo_ac.trainer.checkpoint import Checkpointer, TrainingState, check_checkpoint_paths
from nemo_ac.trainer.checkpoint_files import step_dir
from nemo_ac.trainer.hf_weights import check_hf_weights, export_final_hf
from nemo_ac.trainer.metrics import MetricsLogger, StepMetrics
from nemo_ac.trainer.stop import StopSignal, signal_name
from nemo_ac.workarounds.rendezvous_shared_store import elastic_restart_hazard


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nemo_ac.train", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.steps=10")
    return parser.parse_args(list(argv))


def load_and_validate(
    recipe_path: str, overrides: Sequence[str], *, world_size: int
) -> tuple[RecipeConfig, ParallelLayout]:
    """Everything that can be wrong with a recipe fails here, before any process group exists."""
    recipe = load_recipe(recipe_path, overrides)
    layout = validate_recipe(recipe, world_size=world_size, source=recipe_path)
    missing = check_environment(recipe, cuda_available=torch.cuda.is_available())
    missing += check_checkpoint_paths(recipe.checkpoint)
    missing += check_hf_weights(recipe)  # a local model.pretrained's config.json must match the recipe
    if missing:
        raise ConfigError(missing, source=recipe_path)
    return recipe, layout


def run(
    recipe: RecipeConfig, layout: ParallelLayout, env: DistEnv, stop: StopSignal | None = None
) -> list[StepMetrics]:
    """Build, restore, train, export, summarize. ``stop`` (installed by ``main``): a SIGTERM / SIGINT ends the
    loop on every rank after the same step, which is then saved (``finish_on_signal``)."""
    setup = build_training(recipe, layout, device=env.device)
    model, plan = setup.model, setup.plan
    # Per-thread compile / recompile / graph-break counts in every step's metrics; warns on eager fallbacks.
    compile_accounting = (
        CompileAccounting(watch_checkpoint_entries=list(plan.applied.compiled_checkpoint_entries)).install()
        if plan.compile is not None
        else None
    )
    if compile_accounting is not None and env.is_main:
        print(f"compile | {plan.compile.backend} | layouts: {', '.join(map(str, plan.compile_layouts()))}")
    if env.is_main:
        Path(recipe.logging.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(recipe.logging.run_dir) / "recipe.yaml").write_text(to_yaml(recipe))
        print(
            f"nemo_ac | {recipe.name} | world {layout.world_size} = dp_replicate {layout.dp_replicate} x dp_shard "
            f"{layout.dp_shard} x cp {layout.cp} (ep {layout.ep}) | {env.backend} on {env.device} | "
            f"params {sum(p.numel() for p in model.parameters()):,} ({setup.weights})"
            + "".join(f" | frozen {group} {count:,}" for group, count in setup.frozen.items() if count),
            flush=True,
        )
        print("kernels | " + " | ".join(f"{name} {choice}" for name, choice in setup.kernels.items()), flush=True)
        print("\n".join(plan.summary_lines()), flush=True)
    checkpointer = Checkpointer(
        config=recipe.checkpoint, total_steps=recipe.train.steps, recipe=to_dict(recipe), device=env.device
    )
    state = TrainingState(model=model, optimizer=setup.optimizer, scheduler=setup.scheduler, data=setup.data)
    resumed_step = checkpointer.restore(state)
    logger = MetricsLogger(
        resumed_from_step=resumed_step,
        run_dir=recipe.logging.run_dir,
        total_steps=recipe.train.steps,
        enabled=env.is_main,
        jsonl=recipe.logging.jsonl,
        progress_bar=recipe.logging.progress_bar,
        log_every=recipe.logging.log_every,
    )
    metric_sources = compile_accounting.metric_sources() if compile_accounting else {}
    offloader = plan.applied.offloader  # activation_checkpointing.offload: tensors / MiB moved to host memory
    if offloader is not None:
        metric_sources.update(offloader.metric_sources())
    trainer = build_trainer(setup, logger=logger, metric_sources=metric_sources)
    trainer.step = resumed_step
    history = trainer.fit(
        on_step_end=lambda step: checkpointer.on_step_end(step, state),
        should_stop=(lambda: stop.agreed(env.device)) if stop is not None else None,
    )
    if stop is not None and stop.signum:
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
        if env.is_main:
            print(message, file=sys.stderr, flush=True)
        return history
    if recipe.checkpoint.export_hf:
        exported = export_final_hf(model, config=recipe.checkpoint)
        if env.is_main:
            print(f"export | Hugging Face checkpoint at step {trainer.step}: {exported}", flush=True)
    summary_extra = {"resumed_from_step": resumed_step} if resumed_step else {}
    if compile_accounting is not None:
        compile_accounting.close()
        summary_extra.update(compile_accounting.summary())
        if env.is_main:
            print(compile_accounting.report(), flush=True)
    logger.summary(summary_extra or None)
    return history


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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        recipe, layout = load_and_validate(args.recipe, args.overrides, world_size=world_size_from_env())
    except ConfigError as exc:
        print(f"nemo_ac: {exc}", file=sys.stderr)
        return 2
    hazard = elastic_restart_hazard()
    if hazard and os.environ.get("RANK", "0") == "0":
        print(f"nemo_ac WARNING: {hazard}", file=sys.stderr, flush=True)
    stop = StopSignal().install()  # before the process group: a signal during start-up stops before step 1
    env = init_distributed(recipe.dist)
    try:
        run(recipe, layout, env, stop)
    except BaseException:
        destroy_distributed(synchronize=False)
        raise
    destroy_distributed()
    return 0  # also after a SIGTERM / SIGINT stop, whose state is saved (nemo_ac.trainer.stop says why)


if __name__ == "__main__":
    exit_process(main())
