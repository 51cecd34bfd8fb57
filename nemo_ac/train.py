"""Entry point: ``torchrun --nproc-per-node N -m nemo_ac.train RECIPE.yaml [key=value ...]``.

recipe -> validate (before any process group) -> init dist -> meshes -> model on meta -> parallelize ->
materialize -> optimizer/data -> loop -> summary.
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
from nemo_ac.data.loader import SyntheticBatches
from nemo_ac.diagnostics.recompiles import CompileAccounting
from nemo_ac.distributed.compile import compiled_checkpoint_entries, compiled_layouts
from nemo_ac.distributed.env import DistEnv, destroy_distributed, init_distributed, world_size_from_env
from nemo_ac.distributed.mesh import build_meshes
from nemo_ac.distributed.parallelize import parallelize
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.trainer.batching import make_batch_preparer
from nemo_ac.trainer.checkpoint import Checkpointer, TrainingState, check_checkpoint_paths, elastic_restart_hazard
from nemo_ac.trainer.loop import LoopOptions, Trainer
from nemo_ac.trainer.metrics import MetricsLogger, StepMetrics
from nemo_ac.trainer.optim import build_optimizer, build_scheduler


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
    if missing:
        raise ConfigError(missing, source=recipe_path)
    return recipe, layout


def run(recipe: RecipeConfig, layout: ParallelLayout, env: DistEnv) -> list[StepMetrics]:
    torch.manual_seed(recipe.train.seed)
    meshes = build_meshes(layout, device_type=env.device.type)
    model = build_model(recipe.model)
    parallelize(
        model,
        meshes=meshes,
        model_config=recipe.model,
        parallel=recipe.parallel,
        activation_checkpointing=recipe.activation_checkpointing,
        compile=recipe.compile,
        backend=recipe.backend,
    )
    materialize_and_init(model, device=env.device, seed=recipe.train.seed)
    # Per-thread compile / recompile / graph-break counts in every step's metrics; warns on eager fallbacks.
    compile_accounting = (
        CompileAccounting(watch_checkpoint_entries=compiled_checkpoint_entries(model)).install()
        if recipe.compile.enabled
        else None
    )
    if compile_accounting is not None and env.is_main:
        print(f"compile | {recipe.compile.backend} | layouts: {', '.join(map(str, compiled_layouts(model)))}")
    optimizer = build_optimizer(model, recipe.train)
    scheduler = build_scheduler(optimizer, recipe.train)
    data = SyntheticBatches(
        recipe.data,
        vocab_size=recipe.model.vocab_size,
        global_batch_size=recipe.train.global_batch_size,
        micro_batch_size=recipe.train.micro_batch_size,
        dp_rank=meshes.dp_rank,
        dp_size=meshes.dp_size,
        seed=recipe.train.seed,
    )
    if env.is_main:
        Path(recipe.logging.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(recipe.logging.run_dir) / "recipe.yaml").write_text(to_yaml(recipe))
        print(
            f"nemo_ac | {recipe.name} | world {layout.world_size} = dp_replicate {layout.dp_replicate} x dp_shard "
            f"{layout.dp_shard} x cp {layout.cp} (ep {layout.ep}) | {env.backend} on {env.device} | "
            f"params {sum(p.numel() for p in model.parameters()):,}",
            flush=True,
        )
    checkpointer = Checkpointer(
        config=recipe.checkpoint, total_steps=recipe.train.steps, recipe=to_dict(recipe), device=env.device
    )
    state = TrainingState(model=model, optimizer=optimizer, scheduler=scheduler, data=data)
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
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        prepare_batch=make_batch_preparer(cp=layout.cp, cp_rank=meshes.cp_rank, cp_type=recipe.parallel.cp_type),
        device=env.device,
        logger=logger,
        options=LoopOptions(
            steps=recipe.train.steps,
            grad_clip=recipe.train.grad_clip,
            aux_loss_coef=recipe.model.moe.aux_loss_coef,
            backward_on_thread=recipe.train.backward_on_thread,
            fail_after_step=recipe.train.fail_after_step,
            metric_sources=compile_accounting.metric_sources() if compile_accounting else {},
        ),
        loss_group=meshes.loss_group,
    )
    trainer.step = resumed_step
    history = trainer.fit(on_step_end=lambda step: checkpointer.on_step_end(step, state))
    summary_extra = {"resumed_from_step": resumed_step} if resumed_step else {}
    if compile_accounting is not None:
        compile_accounting.close()
        summary_extra.update(compile_accounting.summary())
        if env.is_main:
            print(compile_accounting.report(), flush=True)
    logger.summary(summary_extra or None)
    return history


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
    env = init_distributed(recipe.dist)
    try:
        run(recipe, layout, env)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
