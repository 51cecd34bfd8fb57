"""``nemo-ac`` console script: train (launches torchrun for you), validate (no training), doctor (torch probes),
recipes (the shipped recipes); ``nemo-ac --version``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

from nemo_ac.config import ConfigError, RecipeConfig, check_environment, load_recipe, validate_recipe
from nemo_ac.config.recipes import resolve_recipe, shipped_recipes
from nemo_ac.config.validate import ParallelLayout
from nemo_ac.doctor.args import add_doctor_arguments


def _validate(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        layout = validate_recipe(recipe, world_size=args.world_size, source=args.recipe)
        if recipe.model.pretrained or recipe.checkpoint.export_hf:
            # HF weights: a local model.pretrained's config.json must match the recipe (needs torch + models).
            from nemo_ac.trainer.hf_weights import check_hf_weights

            mismatches = check_hf_weights(recipe)
            if mismatches:
                raise ConfigError(mismatches, source=args.recipe)
        if args.check_env:
            import torch

            missing = check_environment(recipe, cuda_available=torch.cuda.is_available())
            if missing:
                raise ConfigError(missing, source=args.recipe)
        plan_lines = _plan_lines(recipe, layout) if args.plan else []
    except ConfigError as exc:
        print(f"nemo-ac validate: {exc}", file=sys.stderr)
        return 2
    print(
        f"{args.recipe}: OK at world size {layout.world_size}: dp_replicate {layout.dp_replicate} x dp_shard "
        f"{layout.dp_shard} x cp {layout.cp} ({recipe.parallel.cp_type}), ep {layout.ep} x ep_shard {layout.ep_shard}"
    )
    for line in plan_lines:
        print(line)
    return 0


def _plan_lines(recipe: RecipeConfig, layout: ParallelLayout) -> list[str]:
    """The parallel plan the run would print at start, decided on the model on meta (imports torch)."""
    from nemo_ac.trainer.build import plan_recipe

    return plan_recipe(recipe, layout, device_type=recipe.dist.device).summary_lines()


def _train(args: argparse.Namespace) -> int:
    if args.nnodes > 1 and not args.rdzv_endpoint:
        print(
            f"nemo-ac train: --nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node, e.g. the "
            "first node's hostname:29500); README 'Multi-node'",
            file=sys.stderr,
        )
        return 2
    if args.nnodes < 1 or args.nproc_per_node < 1:
        print("nemo-ac train: --nnodes and --nproc-per-node must be >= 1", file=sys.stderr)
        return 2
    world_size = args.nproc_per_node * args.nnodes
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        validate_recipe(recipe, world_size=world_size, source=args.recipe)
    except ConfigError as exc:
        print(f"nemo-ac train: {exc}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}"]
    if args.nnodes == 1:
        command.append("--standalone")
    else:
        command += [f"--nnodes={args.nnodes}", f"--rdzv-endpoint={args.rdzv_endpoint}", "--rdzv-backend=c10d"]
        if args.rdzv_id:
            command.append(f"--rdzv-id={args.rdzv_id}")
    if args.max_restarts:
        command.append(f"--max-restarts={args.max_restarts}")
    command += ["-m", "nemo_ac.train", args.recipe, *args.overrides]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.max_restarts:  # a fresh rendezvous store per attempt (see trainer.checkpoint.elastic_restart_hazard)
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return subprocess.call(command, env=env)


def _recipes(args: argparse.Namespace) -> int:
    if args.overrides:
        print(f"nemo-ac recipes: takes no overrides: {' '.join(args.overrides)}", file=sys.stderr)
        return 2
    recipes = shipped_recipes()
    if not recipes:
        print("nemo-ac recipes: no recipes shipped with this installation", file=sys.stderr)
        return 1
    width = max(len(recipe.name) for recipe in recipes)
    for recipe in recipes:
        print(f"{recipe.name:<{width}}  {recipe.description}")
        print(f"{'':<{width}}  {recipe.path}")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nemo_ac")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _doctor(args: argparse.Namespace) -> int:
    if args.overrides:
        print(f"nemo-ac doctor: takes no overrides: {' '.join(args.overrides)}", file=sys.stderr)
        return 2
    from nemo_ac.doctor.runner import doctor_main  # imports torch: only when the command runs

    return doctor_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-ac")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    recipe_help = "a recipe YAML path, or a shipped recipe's name (nemo-ac recipes)"
    train = sub.add_parser("train", help="launch torchrun on a recipe")
    train.add_argument("recipe", type=resolve_recipe, help=recipe_help)
    train.add_argument("--nproc-per-node", type=int, default=1)
    train.add_argument("--nnodes", type=int, default=1)
    train.add_argument(
        "--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous, the same on every node (--nnodes > 1)"
    )
    train.add_argument("--rdzv-id", default=None, help="rendezvous (job) id, e.g. $SLURM_JOB_ID (--nnodes > 1)")
    train.add_argument("--max-restarts", type=int, default=0)
    train.set_defaults(func=_train)

    validate = sub.add_parser("validate", help="check a recipe for a world size without training")
    validate.add_argument("recipe", type=resolve_recipe, help=recipe_help)
    validate.add_argument("--world-size", type=int, required=True)
    validate.add_argument("--check-env", action="store_true", help="also require the optional extras it names")
    validate.add_argument("--plan", action="store_true", help="also print the parallel plan the run would apply")
    validate.set_defaults(func=_validate)

    doctor = sub.add_parser(
        "doctor", help="which FSDP2 + selective AC + compile failures this torch has, and whether nemo_ac fixes them"
    )
    add_doctor_arguments(doctor)
    doctor.set_defaults(func=_doctor)

    recipes = sub.add_parser("recipes", help="list the recipes shipped with nemo_ac (name, description, path)")
    recipes.set_defaults(func=_recipes)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Options and key=value overrides may be interleaved: everything argparse does not know must be an override.
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    unknown = [item for item in rest if item.startswith("-") or "=" not in item]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (overrides look like section.key=value)")
    args.overrides = rest
    return int(args.func(args))


if __name__ == "__main__":
    from nemo_ac.distributed.env import exit_process  # no interpreter teardown (see its docstring)

    exit_process(main())
