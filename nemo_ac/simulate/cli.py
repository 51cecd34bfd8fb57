"""``nemo-ac plan`` and ``nemo-ac validate --gpu``: argument handling around ``simulate`` and ``PlanReport``.

Every failure is one line and exit 2: a recipe error (``ConfigError``, named by key), an unknown GPU, a world size
the layout cannot use, or a step that fails under fake tensors (``SimulationError``, naming the op).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.load import load_recipe
from nemo_ac.config.schema import RecipeConfig
from nemo_ac.simulate.gpus import GpuSpec, gpu_spec
from nemo_ac.simulate.inputs import DataAssumption
from nemo_ac.simulate.report import SHRINKS, PlanReport
from nemo_ac.simulate.routing import RoutingAssumption
from nemo_ac.simulate.run import Simulation, SimulationError, SimulationOptions, quiet_known_warnings, simulate

DEFAULT_GPUS = ("h100-80gb", "h200-141gb")


def one_line(exc: ConfigError) -> str:
    """A problem with the command's own arguments (``--gpu``, ``--imbalance``, ...) in one line; recipe problems in
    the recipe error's usual form."""
    if len(exc.issues) == 1 and exc.issues[0].key.startswith("--"):
        return str(exc.issues[0])
    return str(exc)


def recipe_world_size(recipe: RecipeConfig) -> int | None:
    """The world size a recipe fixes by itself (every degree given), else None."""
    par = recipe.parallel
    if par.dp_shard == -1:
        return None
    return max(par.dp_replicate, 1) * par.dp_shard * max(par.cp, 1)


def gpu_specs(values: Sequence[str] | None, *, host_memory_gib: float | None = None) -> list[GpuSpec]:
    """The ``--gpu`` specs; ``host_memory_gib`` (``--host-memory``) replaces their nodes' system memory."""
    names = [name.strip() for value in (values or []) for name in value.split(",") if name.strip()]
    specs = [gpu_spec(name) for name in names or DEFAULT_GPUS]
    if host_memory_gib is None:
        return specs
    if not host_memory_gib > 0:
        raise ConfigError(ConfigIssue("--host-memory", f"{host_memory_gib}: give the GiB of system memory per node"))
    return [dataclasses.replace(spec, host_memory_bytes=int(host_memory_gib * 2**30)) for spec in specs]


def micro_batch_limit(value: str) -> int | None:
    if value == "all":
        return None
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ConfigError(ConfigIssue("--micro-batches", f"{value!r}: give a number >= 1 or 'all'"))
    return limit


def dry_run(
    recipe_path: str,
    overrides: Sequence[str],
    *,
    world_size: int | None,
    options: SimulationOptions | None = None,
    depth: str = "full",
) -> Simulation:
    """Preflight at the world size (the run's own checks, environment excluded), then the dry run."""
    from nemo_ac.preflight import preflight

    if world_size is None:
        world_size = recipe_world_size(load_recipe(recipe_path, overrides))
        if world_size is None:
            raise ConfigError(
                ConfigIssue(
                    "--world-size",
                    "is needed: parallel.dp_shard is -1 (the recipe runs at any world size); give the ranks to plan for",
                ),
                source=recipe_path,
            )
    checked = preflight(recipe_path, overrides, world_size=world_size, check_env=False)
    options = options or SimulationOptions(world_size=world_size)
    if depth == "scaled":
        from nemo_ac.simulate.scaled import simulate_scaled

        return simulate_scaled(checked.recipe, checked.layout, options)
    return simulate(checked.recipe, checked.layout, options)


def check_picture_paths(*, trace: str | None, memory_plot: str | None, depth: str) -> bool:
    """Refuse, before the dry run, what cannot be drawn: a depth-scaled step (no one step to draw), a missing
    Pillow, a directory that does not exist."""
    for key, path in (("--trace", trace), ("--memory-plot", memory_plot)):
        if path is None:
            continue
        if depth != "full":
            raise ConfigError(ConfigIssue(key, "draws one full-depth step: drop --depth scaled"))
        parent = Path(path).resolve().parent
        if not parent.is_dir():
            raise ConfigError(ConfigIssue(key, f"{path}: the directory {parent} does not exist"))
    if memory_plot is not None:
        try:
            import PIL  # noqa: F401
        except ImportError:
            raise ConfigError(ConfigIssue("--memory-plot", "needs Pillow: pip install pillow")) from None
    return trace is not None or memory_plot is not None


def write_pictures(simulation: Simulation, gpu: GpuSpec, *, trace: str | None, memory_plot: str | None) -> list[str]:
    from nemo_ac.simulate.trace import memory_series, replayed_spans, step_timeline, write_memory_plot

    counts = simulation.measurement.counts
    events, starts = step_timeline(counts, gpu=gpu)
    lines = []
    if trace:
        Path(trace).write_text(json.dumps(events))
        lines.append(
            f"plan | trace of the estimated step on {gpu.name} written to {trace} ({len(events['traceEvents']):,} "
            f"events, {events['otherData']['end_s']:.2f} s; open in ui.perfetto.dev)"
        )
    if memory_plot:
        series = memory_series(simulation.measurement.timeline, starts)
        title = f"{simulation.recipe.name}: device memory per rank over the estimated step on {gpu.name}"
        write_memory_plot(memory_plot, series, title=title, replayed=replayed_spans(events))
        lines.append(f"plan | memory plot written to {memory_plot} ({len(series):,} samples)")
    return lines


def run_plan(args: argparse.Namespace) -> int:
    quiet_known_warnings()
    try:
        gpus = gpu_specs(args.gpu, host_memory_gib=args.host_memory)
        if args.jobs is not None and args.jobs < 1:
            raise ConfigError(ConfigIssue("--jobs", f"{args.jobs}: give a number of processes >= 1"))
        if args.doc_tokens is not None and args.doc_tokens < 1:
            raise ConfigError(ConfigIssue("--doc-tokens", f"{args.doc_tokens}: give a number of tokens >= 1"))
        pictures = check_picture_paths(trace=args.trace, memory_plot=args.memory_plot, depth=args.depth)
        options = SimulationOptions(
            world_size=args.world_size or 0,
            routing=RoutingAssumption(imbalance=args.imbalance),
            data=DataAssumption(doc_tokens=args.doc_tokens),
            micro_batch_limit=None if args.against else micro_batch_limit(args.micro_batches),
            rank=args.rank,
            memory_timeline=args.memory_plot is not None,
        )
        if args.sweep or args.search:
            from nemo_ac.simulate.sweep import default_jobs, run_search, run_sweep

            base = dry_run(args.recipe, args.overrides, world_size=args.world_size, options=options, depth="scaled")
            jobs = args.jobs if args.jobs is not None else default_jobs()
            if args.search:
                return run_search(base, gpus=gpus, options=options, jobs=jobs)
            return run_sweep(base, gpus=gpus, options=options, jobs=jobs)
        simulation = dry_run(args.recipe, args.overrides, world_size=args.world_size, options=options, depth=args.depth)
    except ConfigError as exc:
        print(f"nemo-ac plan: {one_line(exc)}", file=sys.stderr)
        return 2
    except SimulationError as exc:
        print(f"nemo-ac plan: {exc}", file=sys.stderr)
        return 2
    report = PlanReport.build(simulation, gpus)
    print("\n".join(report.lines()))
    if args.json:
        report.write_json(args.json)
        print(f"plan | JSON written to {args.json}")
    if pictures:
        for line in write_pictures(simulation, gpus[0], trace=args.trace, memory_plot=args.memory_plot):
            print(line)
    if args.against:
        from nemo_ac.simulate.accuracy import compare, profile_lines, read_measured, step_time_line

        try:
            measured = read_measured(args.against, args.rank)
        except (OSError, ValueError) as exc:
            print(
                f"nemo-ac plan: --against {args.against}: no measured step of rank {args.rank} ({exc})", file=sys.stderr
            )
            return 2
        print(compare(simulation, measured).line())
        step_line = step_time_line(measured, report.estimates[0])
        if step_line is not None:
            print(step_line)
        for line in profile_lines(measured.get("profile") or {}, report.estimates[0]):
            print(line)
        if measured.get("cuda_max_allocated_bytes"):
            print(
                f"against | torch.cuda.max_memory_allocated {measured['cuda_max_allocated_bytes']:,} B (the "
                "allocator's own count, steps included); tracked peak of the measured step "
                f"{measured['peak_bytes']:,} B"
            )
    return 0


def memory_refusal(report: PlanReport) -> str | None:
    """Why the recipe does not fit the report's GPU (its largest term and the keys that shrink it), or None."""
    fit = report.fits[0]
    if fit.fits:
        return None
    if not fit.host_fits:
        return (
            f"host memory: the node's ranks keep {fit.host_bytes_per_node / 2**30:,.1f} GiB in host memory "
            f"({', '.join(report.simulation.host_bytes)}), more than its {fit.host_memory_bytes / 2**30:,.1f} GiB "
            f"(--host-memory); set train.optimizer_offload=none or activation_checkpointing.offload=false, or use "
            "more ranks"
        )
    term, size = report.simulation.measurement.peak.largest_terms(1)[0]
    return (
        f"estimated peak {fit.peak_bytes / 2**30:,.1f} GiB per rank exceeds the {fit.usable_bytes / 2**30:,.1f} GiB "
        f"usable on {fit.gpu}; the largest term is {term} ({size / 2**30:,.1f} GiB): shrink it with "
        f"{SHRINKS.get(term, 'train.micro_batch_size or more ranks')} (nemo-ac plan for the breakdown)"
    )
