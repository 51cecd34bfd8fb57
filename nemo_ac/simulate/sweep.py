"""``nemo-ac plan RECIPE --sweep``: the recipe's layout and its neighbours at the same world size, dry-run and ranked;
``--search``: from the recipe, move to the fastest neighbour that fits until none is faster.

A neighbour changes one choice of the recipe: expert parallel halved or doubled, context parallel halved or doubled
(each CP type that validates), the other CP type, full instead of selective activation checkpointing (or selective
instead of full), the micro batch halved or doubled, AdamW's states on the host instead of the device (or back), the
loss in 1024-token chunks instead of whole logits (or back). Each candidate that validates is dry-run with ``--depth
scaled`` (one block of each kind, scaled: minutes for the whole sweep, not hours) and kept when its estimated peak
fits every GPU asked for; the rest are listed with the reason. The ranking key is the estimated step time on the
first GPU (the estimate: compiled blocks fused, calibrated): an estimate, as every number of the plan.

The search is a hill climb over the same moves plus FSDP's reshard after forward (kept or not), HSDP (dp_replicate
doubled or halved), the AC mode of one block kind (``activation_checkpointing.by_block``: toward less recompute
while the layout fits, toward more while it does not, so each round tries half the modes) and, where a block is
selective, saving the collectives' outputs or not (``selective.save_communication``): each round dry-runs the
neighbours of the best layout so far that no round has tried, and moves to the fastest that fits; it stops when no
neighbour is faster, after ``max_rounds``, and prints the override line that runs the layout it found, after one
more dry run of that layout at full depth: where its peak does not fit there (the depth-scaled peak is an
extrapolation), the layout of the round before is offered and checked instead. Pruning: a layout is dry-run once,
and only the best layout's neighbours are expanded (a local search: it finds the best layout reachable by single
changes that each help, not a proven optimum).

Each round's candidates are independent dry runs: ``--jobs N`` runs them in N worker processes (spawned: each dry run
sets up its own fake process group, as in the main process), default one per CPU core. The results are read back in
the candidates' order, so the layout a round moves to is the one a single process finds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass

from nemo_ac.config.errors import ConfigError
from nemo_ac.config.schema import RecipeConfig
from nemo_ac.config.validate import validate_recipe
from nemo_ac.simulate.gpus import GpuSpec
from nemo_ac.simulate.report import PlanReport, seconds, size
from nemo_ac.simulate.run import (
    Simulation,
    SimulationError,
    SimulationOptions,
    quiet_known_warnings,
    simulate,
)
from nemo_ac.simulate.scaled import simulate_scaled


@dataclass
class Candidate:
    label: str
    recipe: RecipeConfig
    own: bool = False
    report: PlanReport | None = None
    rejected: str = ""


def _with(recipe: RecipeConfig, **changes: object) -> RecipeConfig:
    parallel = {k: v for k, v in changes.items() if k in ("ep", "cp", "cp_type", "dp_replicate")}
    out = dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, dp_shard=-1, **parallel))
    if "reshard" in changes:
        fsdp = dataclasses.replace(out.parallel.fsdp, reshard_after_forward=changes["reshard"])
        out = dataclasses.replace(out, parallel=dataclasses.replace(out.parallel, fsdp=fsdp))
    if "ac" in changes:
        ac = dataclasses.replace(out.activation_checkpointing, mode=changes["ac"], by_block={})  # every block
        if changes["ac"] == "selective":
            ac = dataclasses.replace(ac, offload=False)
        out = dataclasses.replace(out, activation_checkpointing=ac)
    if "save_communication" in changes:
        ac = out.activation_checkpointing
        selective = dataclasses.replace(ac.selective, save_communication=changes["save_communication"])
        out = dataclasses.replace(out, activation_checkpointing=dataclasses.replace(ac, selective=selective))
    if "ac_block" in changes:  # (block kind, mode): one kind's mode; a mode equal to the recipe's leaves the key out
        kind, mode = changes["ac_block"]  # type: ignore[misc]
        ac = out.activation_checkpointing
        by_block = {k: v for k, v in ac.by_block.items() if k != kind} | ({} if mode == ac.mode else {kind: mode})
        out = dataclasses.replace(out, activation_checkpointing=dataclasses.replace(ac, by_block=by_block))
    if "in_flight" in changes:
        ac = dataclasses.replace(out.activation_checkpointing, offload_in_flight=changes["in_flight"])
        out = dataclasses.replace(out, activation_checkpointing=ac)
    if "mb" in changes:
        out = dataclasses.replace(out, train=dataclasses.replace(out.train, micro_batch_size=changes["mb"]))
    if "offload" in changes:
        out = dataclasses.replace(out, train=dataclasses.replace(out.train, optimizer_offload=changes["offload"]))
    if "chunk" in changes:
        out = dataclasses.replace(out, train=dataclasses.replace(out.train, loss_chunk_tokens=changes["chunk"]))
    if "state_dtype" in changes:
        train = dataclasses.replace(out.train, optimizer_state_dtype=changes["state_dtype"])
        out = dataclasses.replace(out, train=train)
    if "master_dtype" in changes:
        out = dataclasses.replace(out, train=dataclasses.replace(out.train, master_dtype=changes["master_dtype"]))
    return out


# What a search may change, as recipe keys: the layout key and the override line are read from these.
SEARCHED_KEYS = (
    "parallel.ep",
    "parallel.cp",
    "parallel.cp_type",
    "parallel.dp_replicate",
    "parallel.fsdp.reshard_after_forward",
    "activation_checkpointing.mode",
    "activation_checkpointing.offload",
    "activation_checkpointing.offload_in_flight",
    "activation_checkpointing.selective.save_communication",
    "train.micro_batch_size",
    "train.optimizer_offload",
    "train.optimizer_state_dtype",
    "train.master_dtype",
    "train.loss_chunk_tokens",
)


BY_BLOCK = "activation_checkpointing.by_block"
# The search's largest activation_checkpointing.offload_in_flight: beyond a few blocks the copies are long hidden, and
# --depth scaled counts the bound exactly only below its runs' block count (docs/offload.md).
MOST_OFFLOAD_IN_FLIGHT = 3
AC_MODES = ("full", "selective", "none")  # heaviest recompute first


def _value(recipe: RecipeConfig, key: str) -> object:
    value: object = recipe
    for part in key.split("."):
        value = getattr(value, part)
    return value


def layout_key(recipe: RecipeConfig) -> tuple:
    """What the search compares layouts by: every searched key, and each block kind whose AC mode is not ``mode``."""
    ac = recipe.activation_checkpointing
    by_block = tuple(sorted((kind, mode) for kind, mode in ac.by_block.items() if mode != ac.mode))
    return (*(_value(recipe, key) for key in SEARCHED_KEYS), by_block)


def _by_block_overrides(original: RecipeConfig, recipe: RecipeConfig) -> list[str]:
    """``by_block.KIND=MODE`` for each kind whose mode differs once the other overrides (``mode``) are applied."""
    mode = recipe.activation_checkpointing.mode
    before, after = original.activation_checkpointing.by_block, recipe.activation_checkpointing.by_block
    return [f"{BY_BLOCK}.{kind}={after.get(kind, mode)}" for kind in sorted(set(before) | set(after))
            if after.get(kind, mode) != before.get(kind, mode)]  # fmt: skip


def overrides(original: RecipeConfig, recipe: RecipeConfig) -> list[str]:
    """The ``key=value`` overrides that turn ``original`` into ``recipe`` (over ``SEARCHED_KEYS`` and ``by_block``)."""
    out = [f"{key}={str(_value(recipe, key)).lower() if isinstance(_value(recipe, key), bool) else _value(recipe, key)}"
           for key in SEARCHED_KEYS if _value(recipe, key) != _value(original, key)]  # fmt: skip
    out += _by_block_overrides(original, recipe)
    if out and original.parallel.dp_shard != -1:
        out.insert(0, "parallel.dp_shard=-1")
    return out


def neighbours(
    recipe: RecipeConfig, *, search: bool = False, block_kinds: tuple[str, ...] = (), lighter: bool = True
) -> list[Candidate]:
    """The recipe itself, then each one-choice change of it (``search``: also reshard and HSDP moves, and the AC mode
    of each of ``block_kinds``: toward less recompute when ``lighter``, the layout fitting, else toward more)."""
    par, ac, mb = recipe.parallel, recipe.activation_checkpointing.mode, recipe.train.micro_batch_size
    out = [Candidate(f"ep {par.ep} cp {par.cp} {par.cp_type} AC {ac} mb {mb} (the recipe)", recipe, own=True)]

    def add(label: str, **changes: object) -> None:
        out.append(Candidate(label, _with(recipe, **changes)))

    if recipe.model.moe.num_experts > 1 and par.ep > 1:
        add(f"ep {par.ep // 2}", ep=par.ep // 2)
    if recipe.model.moe.num_experts >= 2 * par.ep:
        add(f"ep {par.ep * 2}", ep=par.ep * 2)
    for cp in (par.cp // 2, par.cp * 2):
        if cp >= 1 and cp != par.cp:
            for kind in ("ulysses", "ring") if cp > 1 else (par.cp_type,):
                add(f"cp {cp}" + (f" {kind}" if cp > 1 else ""), cp=cp, cp_type=kind)
    if par.cp > 1:
        other = "ring" if par.cp_type == "ulysses" else "ulysses"
        add(f"cp {par.cp} {other}", cp_type=other)
    if ac in ("selective", "full"):
        add(f"AC {'full' if ac == 'selective' else 'selective'}", ac="full" if ac == "selective" else "selective")
    if mb > 1:
        add(f"mb {mb // 2}", mb=mb // 2)
    add(f"mb {mb * 2}", mb=mb * 2)
    # The memory levers (docs/planning.md, "Memory levers"): every other optimizer offload (states only for the
    # built-in AdamW with fp32 moments), every other dtype of the moments (built-in AdamW; a low-precision one leaves
    # the states offload), the loss chunked or not.
    built_in, moments = recipe.train.optimizer is None, recipe.train.optimizer_state_dtype
    fp32_only = built_in and moments == "float32" and recipe.train.master_dtype == "float32"
    for other in ("none", "states", "full"):
        if other != recipe.train.optimizer_offload and (other != "states" or fp32_only):
            add(f"optimizer_offload {other}", offload=other)
    for dtype in ("float32", "bfloat16", "float8") if built_in else ():
        if dtype == moments:
            continue
        leave_states = {"offload": "none"} if dtype != "float32" and recipe.train.optimizer_offload == "states" else {}
        add(f"optimizer_state_dtype {dtype}" + (" (offload none)" if leave_states else ""), state_dtype=dtype,
            **leave_states)  # fmt: skip
    # bf16 masters where they can run (the built-in AdamW, bf16 compute, no states-only offload), or back to fp32.
    if built_in and recipe.parallel.fsdp.param_dtype == "bfloat16" and recipe.train.optimizer_offload != "states":
        master = "float32" if recipe.train.master_dtype == "bfloat16" else "bfloat16"
        add(f"master_dtype {master}", master_dtype=master)
    chunk = 0 if recipe.train.loss_chunk_tokens else 1024
    add(f"loss_chunk_tokens {chunk}", chunk=chunk)
    if search:
        reshard = not par.fsdp.reshard_after_forward
        add(f"reshard_after_forward {str(reshard).lower()}", reshard=reshard)
        for replicate in (par.dp_replicate * 2, par.dp_replicate // 2):
            if replicate >= 1:
                add(f"dp_replicate {replicate}", dp_replicate=replicate)
        for kind in block_kinds:
            current = AC_MODES.index(recipe.activation_checkpointing.by_block.get(kind, ac))
            for mode in AC_MODES[current + 1 :] if lighter else AC_MODES[:current]:
                add(f"AC {kind} {mode}", ac_block=(kind, mode))
                if mode == "selective" and recipe.activation_checkpointing.selective.save_communication:
                    # Selective MoE blocks keep their dispatch buffers: recomputing the collectives is what lets
                    # them fit, so the climb needs both changes in one move (neither alone helps).
                    add(f"AC {kind} selective, collectives recomputed", ac_block=(kind, mode), save_communication=False)
        # Selective blocks save the collectives' outputs (the EP all-to-alls) unless told not to: the other way.
        if "selective" in {ac, *recipe.activation_checkpointing.by_block.values()}:
            save = not recipe.activation_checkpointing.selective.save_communication
            add(f"save_communication {str(save).lower()}", save_communication=save)
            if not save:
                # Saved dispatch buffers grow with the micro batch: doubling it may fit only with the collectives
                # recomputed, and recomputing them alone only costs time, so the two go in one move.
                add(f"mb {mb * 2}, collectives recomputed", mb=mb * 2, save_communication=False)
        # Offloaded activations: one block more on the device overlaps more copies, one fewer frees a block's.
        if recipe.activation_checkpointing.offload:
            in_flight = recipe.activation_checkpointing.offload_in_flight
            for other in (in_flight - 1, in_flight + 1):
                if 1 <= other <= MOST_OFFLOAD_IN_FLIGHT:
                    add(f"offload_in_flight {other}", in_flight=other)
    return out


def _dry_run(
    recipe: RecipeConfig, world: int, gpus: list[GpuSpec], options: SimulationOptions
) -> tuple[PlanReport | None, str]:
    """One candidate's depth-scaled dry run: ``(report, "")``, or ``(None, why it was rejected)``. A module-level
    function of picklable values: what a worker process runs."""
    try:
        layout = validate_recipe(recipe, world_size=world)
        return PlanReport.build(simulate_scaled(recipe, layout, options), gpus), ""
    except ConfigError as exc:
        return None, "invalid: " + " ".join(str(exc).split())[:160]
    except SimulationError as exc:
        return None, "dry run failed: " + str(exc)[:160]


def _evaluate(candidate: Candidate, *, world: int, gpus: list[GpuSpec], options: SimulationOptions) -> None:
    candidate.report, candidate.rejected = _dry_run(candidate.recipe, world, gpus, options)


def _evaluate_all(
    candidates: Sequence[Candidate],
    *,
    world: int,
    gpus: list[GpuSpec],
    options: SimulationOptions,
    pool: Executor | None,
) -> None:
    """Dry-run ``candidates``: in ``pool``'s workers where there is one (results in the candidates' order), else one
    after the other here."""
    if pool is None or len(candidates) < 2:
        for candidate in candidates:
            _evaluate(candidate, world=world, gpus=gpus, options=options)
        return
    n = len(candidates)
    results = pool.map(_dry_run, [c.recipe for c in candidates], [world] * n, [gpus] * n, [options] * n)
    for candidate, (report, rejected) in zip(candidates, results, strict=True):
        candidate.report, candidate.rejected = report, rejected


@contextlib.contextmanager
def worker_pool(jobs: int) -> Iterator[ProcessPoolExecutor | None]:
    """``jobs`` spawned worker processes for the dry runs, shut down on leaving; None for one (everything in this
    process)."""
    if jobs <= 1:
        yield None
        return
    with ProcessPoolExecutor(
        max_workers=jobs, mp_context=multiprocessing.get_context("spawn"), initializer=quiet_known_warnings
    ) as pool:
        yield pool


def default_jobs() -> int:
    """One worker per CPU core this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _fits(candidate: Candidate) -> bool:
    return candidate.report is not None and all(f.fits for f in candidate.report.fits)


def _step(candidate: Candidate) -> float:
    return candidate.report.estimates[0].step_s  # type: ignore[union-attr]


def run_sweep(base: Simulation, *, gpus: list[GpuSpec], options: SimulationOptions, jobs: int = 1) -> int:
    """Print the recipe's neighbours that fit, fastest first, and why the others do not. ``base`` is the recipe's own
    depth-scaled dry run (its errors reach the caller, which prints them as every plan error); ``jobs`` worker
    processes dry-run the neighbours."""
    world = base.layout.world_size
    candidates = neighbours(base.recipe)
    for candidate in candidates:
        if candidate.own:
            candidate.report = PlanReport.build(base, gpus)
    with worker_pool(jobs) as pool:
        _evaluate_all([c for c in candidates if not c.own], world=world, gpus=gpus, options=options, pool=pool)
    print(f"sweep | {base.recipe.name} at world size {world}, estimates on {gpus[0].name} (depth scaled)")
    fitting = [c for c in candidates if c.report and all(f.fits for f in c.report.fits)]
    fitting.sort(key=lambda c: c.report.estimates[0].step_s)  # type: ignore[union-attr]
    for rank, c in enumerate(fitting, 1):
        e, f = c.report.estimates[0], c.report.fits[0]  # type: ignore[union-attr]
        print(
            f"sweep | {rank:2d}. {c.label:<48} step {seconds(e.step_s):>10}  MFU {e.mfu:5.1%}  peak "
            f"{size(f.peak_bytes):>11}" + ("  <- the recipe" if c.own else "")
        )
    for c in candidates:
        if c in fitting:
            continue
        why = c.rejected
        if not why and c.report is not None:
            over = [
                f"{f.gpu} {f.peak_bytes / 2**30:,.1f} GiB > {f.usable_bytes / 2**30:,.1f}"
                for f in c.report.fits
                if not f.fits
            ]
            why = "does not fit: " + ", ".join(over)
        print(f"sweep |  -  {c.label:<48} {why}" + ("  <- the recipe" if c.own else ""))
    return 0


@dataclass
class SearchResult:
    best: Candidate
    moves: list[Candidate]  # the layout each round moved to, in order
    tried: int  # layouts dry-run, the recipe's own included
    wall_s: float


def search_layouts(
    base: Simulation,
    *,
    gpus: list[GpuSpec],
    options: SimulationOptions,
    max_rounds: int = 4,
    pool: Executor | None = None,
) -> SearchResult:
    """The hill climb of the module docstring from the recipe's own layout (``base``, depth scaled); each round's
    dry runs in ``pool``'s workers where one is given."""
    started = time.perf_counter()
    world = base.layout.world_size
    original = base.recipe
    best = Candidate("the recipe", original, own=True, report=PlanReport.build(base, gpus))
    kinds = tuple(dict.fromkeys(block.ac_key for block in base.plan.blocks))
    seen = {layout_key(original)}
    moves: list[Candidate] = []
    tried = 1
    for _ in range(max_rounds):
        found: Candidate | None = None
        untried = []
        for candidate in neighbours(best.recipe, search=True, block_kinds=kinds, lighter=_fits(best))[1:]:
            key = layout_key(candidate.recipe)
            if key not in seen:
                seen.add(key)
                untried.append(candidate)
        tried += len(untried)
        _evaluate_all(untried, world=world, gpus=gpus, options=options, pool=pool)
        for candidate in untried:
            reference = found or best
            if _fits(candidate) and (not _fits(reference) or _step(candidate) < _step(reference)):
                found = candidate
        if found is None:
            break
        best = found
        moves.append(found)
    return SearchResult(best=best, moves=moves, tried=tried, wall_s=time.perf_counter() - started)


def run_search(
    base: Simulation, *, gpus: list[GpuSpec], options: SimulationOptions, max_rounds: int = 4, jobs: int = 1
) -> int:
    """Print the search's rounds, the layout it ends on and the overrides that run it; ``jobs`` worker processes
    dry-run each round's candidates."""
    world = base.layout.world_size
    print(
        f"search | {base.recipe.name} on {world} x {gpus[0].name}, from the recipe (depth scaled, "
        f"{jobs} dry run{'s' if jobs > 1 else ''} at a time)"
    )
    with worker_pool(jobs) as pool:
        result = search_layouts(base, gpus=gpus, options=options, max_rounds=max_rounds, pool=pool)
    for number, move in enumerate(result.moves, 1):
        e, f = move.report.estimates[0], move.report.fits[0]  # type: ignore[union-attr]
        print(f"search | round {number}: {move.label:<34} step {seconds(e.step_s):>10}  peak {size(f.peak_bytes)}")
    return offer(base, result, gpus=gpus, options=options)


def offer(base: Simulation, result: SearchResult, *, gpus: list[GpuSpec], options: SimulationOptions) -> int:
    """Print the search's answer and its override line once a full-depth dry run says it fits; where it does not,
    the layout of the round before it, and so on back to the recipe. Exit status 1 when none fits."""
    world = base.layout.world_size
    if not _fits(result.best):
        print(f"search | no layout that fits {gpus[0].name} found ({result.tried} dry-run, {result.wall_s:.0f} s)")
        return 1
    own = Candidate("the recipe", base.recipe, own=True, report=PlanReport.build(base, gpus))
    for best in [*reversed(result.moves), own] if result.moves else [own]:
        if not _fits(best):
            continue
        e, f = best.report.estimates[0], best.report.fits[0]  # type: ignore[union-attr]
        tokens = base.tokens_per_step / e.step_s / world
        line = " ".join(overrides(base.recipe, best.recipe)) or "(the recipe as it is)"
        print(
            f"search | best: step {seconds(e.step_s)}, {tokens:,.0f} tokens/s per GPU, MFU {e.mfu:.1%}, peak "
            f"{size(f.peak_bytes)} ({result.tried} layouts dry-run, {result.wall_s:.0f} s)"
        )
        print(f"search | overrides: {line}")
        if _check_at_full_depth(best, world=world, gpus=gpus, options=options) == 0:
            return 0
    return 1


def _check_at_full_depth(best: Candidate, *, world: int, gpus: list[GpuSpec], options: SimulationOptions) -> int:
    """The search ranks depth-scaled dry runs, whose peak extrapolates activations per block: its answer is dry-run
    once more at full depth before it is offered, and refused (exit 1) when that peak does not fit."""
    started = time.perf_counter()
    layout = validate_recipe(best.recipe, world_size=world)
    report = PlanReport.build(simulate(best.recipe, layout, options), gpus)
    e, f = report.estimates[0], report.fits[0]
    fits = all(fit.fits for fit in report.fits)
    print(
        f"search | checked at full depth: step {seconds(e.step_s)}, peak {size(f.peak_bytes)}, "
        f"{'fits' if fits else 'DOES NOT FIT'} {gpus[0].name} ({time.perf_counter() - started:.0f} s)"
    )
    return 0 if fits else 1
