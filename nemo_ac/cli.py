"""``nemo-ac`` console script: train (launches torchrun for you), validate (no training), tokenize (a text recipe's
corpus into its cache, once), export (a DCP checkpoint -> a Hugging Face model directory), doctor (torch probes),
recipes (the shipped recipes); ``nemo-ac --version``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from nemo_ac.config import ConfigError
from nemo_ac.config.errors import ConfigIssue
from nemo_ac.config.recipes import resolve_recipe, shipped_recipes
from nemo_ac.doctor.args import add_doctor_arguments


def _validate(args: argparse.Namespace) -> int:
    from nemo_ac.preflight import preflight  # the trainer's own checks (nemo_ac.train runs the same function)

    try:
        checked = preflight(args.recipe, args.overrides, world_size=args.world_size, check_env=args.check_env)
        recipe, layout = checked.recipe, checked.layout
        plan_lines = checked.plan.summary_lines() if args.plan and checked.plan is not None else []
        memory_lines = _memory_lines(args) if args.gpu else []
    except ConfigError as exc:
        print(f"nemo-ac validate: {exc}", file=sys.stderr)
        return 2
    print(
        f"{args.recipe}: OK at world size {layout.world_size}: dp_replicate {layout.dp_replicate} x dp_shard "
        f"{layout.dp_shard} x cp {layout.cp} ({recipe.parallel.cp_type}), ep {layout.ep} x ep_shard {layout.ep_shard}"
    )
    for line in [*plan_lines, *memory_lines, *(f"note | {note}" for note in checked.notes)]:
        print(line)
    return 0


def _memory_lines(args: argparse.Namespace) -> list[str]:
    """``--gpu``: the dry run's peak against that GPU; a recipe that does not fit is a ConfigError (exit 2)."""
    from nemo_ac.simulate.cli import dry_run, gpu_specs, memory_refusal
    from nemo_ac.simulate.report import PlanReport
    from nemo_ac.simulate.run import SimulationError

    gpus = gpu_specs([args.gpu])
    try:
        simulation = dry_run(args.recipe, args.overrides, world_size=args.world_size, depth="scaled")
    except SimulationError as exc:
        raise ConfigError(ConfigIssue("--gpu", f"the dry run failed: {exc}"), source=args.recipe) from exc
    report = PlanReport.build(simulation, gpus)
    refusal = memory_refusal(report)
    if refusal is not None:
        raise ConfigError(ConfigIssue("--gpu", refusal), source=args.recipe)
    fit = report.fits[0]
    return [
        f"memory | fits {fit.gpu}: estimated peak {fit.peak_bytes / 2**30:,.1f} of {fit.usable_bytes / 2**30:,.1f} "
        f"GiB usable per rank (nemo-ac plan for the breakdown)"
    ]


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
        # The ranks' own check (recipe, extras, checkpoint paths, HF config.json), once, here: a typo never reaches
        # torchrun, whose failure report alone is 40 lines.
        from nemo_ac.train import load_and_validate  # imports torch: only when the command runs

        load_and_validate(args.recipe, args.overrides, world_size=world_size)
    except ConfigError as exc:
        print(f"nemo-ac train: {exc}", file=sys.stderr)
        return 2
    # torchrun in this process (nemo_ac.launch: torchrun with one-line endings): signals reach it directly.
    command = [sys.executable, "-m", "nemo_ac.launch", f"--nproc-per-node={args.nproc_per_node}"]
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
    if (
        args.max_restarts
    ):  # a fresh rendezvous store per attempt (see workarounds.rendezvous_shared_store.elastic_restart_hazard)
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, env)  # this process becomes torchrun
    return 0  # not reached (the tests replace os.execvpe)


def _export(args: argparse.Namespace) -> int:
    """One line on stderr and exit code 2 for every failure (trainer.checkpoint.export: nothing it reads is lost)."""
    if args.overrides:
        print(f"nemo-ac export: takes no overrides: {' '.join(args.overrides)}", file=sys.stderr)
        return 2
    from nemo_ac.trainer.checkpoint.export import export_checkpoint  # imports torch: only when the command runs

    try:
        done = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, force=args.force)
    except KeyboardInterrupt:
        print(f"nemo-ac export: interrupted; --out {args.out} is as it was before", file=sys.stderr)
        return 130
    except Exception as exc:  # CheckpointError, ConfigError (a manifest's recipe), OSError, a model that will not build
        text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
        known = exc.__class__.__module__.startswith("nemo_ac.")
        print(f"nemo-ac export: {text if known else f'{type(exc).__name__}: {text}'}", file=sys.stderr)
        return 2
    print(f"export | step {done.step} of {done.checkpoint} -> {done.out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from nemo_ac.simulate.cli import run_plan  # imports torch: only when the command runs

    return run_plan(args)


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


def _tokenize(args: argparse.Namespace) -> int:
    """``data.kind: text``: tokenize the corpus into ``data.cache_dir`` now (a login node, shared storage), so that
    no rank of the run tokenizes; an entry already there is only mapped and described."""
    from nemo_ac.config import load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if recipe.data.kind != "text" or recipe.data.source is not None:
            raise ConfigError(
                ConfigIssue("data.kind", f"{recipe.data.kind!r}: only data.kind text has a tokenized corpus to cache"),
                source=args.recipe,
            )
        from nemo_ac.data.corpus import prepare_corpus  # imports torch: only when the command runs

        corpus = prepare_corpus(recipe.data, vocab_size=recipe.model.vocab_size, say=print)
    except ConfigError as exc:
        print(f"nemo-ac tokenize: {exc}", file=sys.stderr)
        return 2
    print(f"{corpus.path}")
    return 0


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
    validate.add_argument(
        "--gpu",
        default=None,
        help="also dry-run one step at full size (nemo-ac plan) and refuse the recipe if its estimated peak memory "
        "per rank exceeds this GPU's (h100-80gb, h200-141gb, b200-180gb, a100-80gb)",
    )
    validate.set_defaults(func=_validate)

    tokenize = sub.add_parser(
        "tokenize",
        help="tokenize a text recipe's corpus into its cache (data.cache_dir) once, e.g. on shared storage before "
        "the job: every rank of every launch then maps it",
    )
    tokenize.add_argument("recipe", type=resolve_recipe, help=recipe_help)
    tokenize.set_defaults(func=_tokenize)

    plan = sub.add_parser(
        "plan",
        help="dry-run one training step of a recipe at its real size and world size in this process: memory per "
        "rank, FLOPs, communication, estimated step time and MFU per GPU",
    )
    plan.add_argument("recipe", type=resolve_recipe, help=recipe_help)
    plan.add_argument(
        "--world-size",
        "--gpus",
        dest="world_size",
        type=int,
        default=None,
        help="ranks (GPUs) to plan for; default: the recipe's own (when it fixes one)",
    )
    plan.add_argument(
        "--gpu",
        action="append",
        default=None,
        help="GPU(s) to estimate for, comma-separated or repeated (default h100-80gb,h200-141gb; also b200-180gb, "
        "a100-80gb)",
    )
    plan.add_argument("--json", default=None, help="also write the report as JSON to this path")
    plan.add_argument(
        "--host-memory",
        type=float,
        default=None,
        metavar="GiB",
        help="system memory per node for offloaded states and activations (default: the GPU's DGX node, "
        "2048 GiB for H100 / H200)",
    )
    plan.add_argument(
        "--imbalance",
        type=float,
        default=1.0,
        help="routing assumption: the busiest expert's load over the mean (1: balanced, the default)",
    )
    plan.add_argument(
        "--doc-tokens",
        type=int,
        default=None,
        help="stand-in rows (data not readable offline): documents of this many tokens (default: one per row)",
    )
    plan.add_argument(
        "--micro-batches",
        default="1",
        help="micro batches of the step to run (the rest counted as the last one run): a number or 'all'",
    )
    plan.add_argument(
        "--depth",
        choices=["full", "scaled"],
        default="full",
        help="full: every block; scaled: one block of each kind (plus one more of each) at real width, scaled to "
        "the real depth (faster; the report says so)",
    )
    plan.add_argument("--rank", type=int, default=0, help="the rank to dry-run (default 0)")
    plan.add_argument(
        "--against",
        default=None,
        help="a directory of a measured step (torchrun ... -m nemo_ac.simulate.measure RECIPE --out DIR): compare "
        "this rank's peak memory, FLOPs and collectives with it (runs every micro batch)",
    )
    plan.add_argument("--sweep", action="store_true", help="rank the layouts that fit at this world size")
    plan.add_argument(
        "--search",
        action="store_true",
        help="from the recipe's layout, move to the fastest neighbouring layout that fits (EP, CP, AC, micro batch, "
        "offload, reshard, HSDP) until none is faster; prints the overrides that run it",
    )
    plan.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="with --sweep / --search: dry-run N candidate layouts at a time, each in its own process (default: one "
        "per CPU core; 1: all in this process)",
    )
    plan.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="write the estimated step (first --gpu) as a Chrome / Perfetto trace: compute, FSDP, EP / CP and host "
        "streams, each op named (open in ui.perfetto.dev or chrome://tracing)",
    )
    plan.add_argument(
        "--memory-plot",
        default=None,
        metavar="PATH",
        help="write a PNG of device memory over the step by term (parameters, gradients, optimizer, activations, "
        "temporaries, buffers), the peak marked (needs Pillow)",
    )
    plan.set_defaults(func=_plan)

    export = sub.add_parser(
        "export", help="write a DCP checkpoint as a Hugging Face model directory (config, safetensors, tokenizer)"
    )
    export.add_argument("checkpoint", help="a run directory, a checkpoint.dir (its newest step) or a step_<N> dir")
    export.add_argument(
        "--out",
        required=True,
        help="the Hugging Face model directory to write, replaced whole: new, empty or an earlier export; never in "
        "the run or checkpoint directory",
    )
    export.add_argument(
        "--force", action="store_true", help="replace a non-empty --out that holds no earlier nemo_ac export"
    )
    export.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="dtype of floating-point weights (default: checkpoint.export_dtype, else as trained)",
    )
    export.set_defaults(func=_export)

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
    from nemo_ac.runtime import exit_process  # no interpreter teardown (see its docstring)

    exit_process(main())
