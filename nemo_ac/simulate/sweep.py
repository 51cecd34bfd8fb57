"""``nemo-ac plan RECIPE --sweep``: the recipe's layout and its neighbours at the same world size, dry-run and ranked.

A neighbour changes one choice of the recipe: expert parallel halved or doubled, context parallel halved or doubled
(each CP type that validates), the other CP type, full instead of selective activation checkpointing (or selective
instead of full), the micro batch halved or doubled, AdamW's states on the host instead of the device (or back), the
loss in 1024-token chunks instead of whole logits (or back). Each candidate that validates is dry-run with ``--depth
scaled`` (one block of each kind, scaled: minutes for the whole sweep, not hours) and kept when its estimated peak
fits every GPU asked for; the rest are listed with the reason. The ranking key is the estimated step time on the
first GPU (the estimate: compiled blocks fused, calibrated): an estimate, as every number of the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nemo_ac.config.errors import ConfigError
from nemo_ac.config.schema import RecipeConfig
from nemo_ac.config.validate import validate_recipe
from nemo_ac.simulate.gpus import GpuSpec
from nemo_ac.simulate.report import PlanReport, seconds, size
from nemo_ac.simulate.run import Simulation, SimulationError, SimulationOptions
from nemo_ac.simulate.scaled import simulate_scaled


@dataclass
class Candidate:
    label: str
    recipe: RecipeConfig
    own: bool = False
    report: PlanReport | None = None
    rejected: str = ""


def _with(recipe: RecipeConfig, **changes: object) -> RecipeConfig:
    parallel = {k: v for k, v in changes.items() if k in ("ep", "cp", "cp_type")}
    out = dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, dp_shard=-1, **parallel))
    if "ac" in changes:
        ac = dataclasses.replace(out.activation_checkpointing, mode=changes["ac"])
        if changes["ac"] == "selective":
            ac = dataclasses.replace(ac, offload=False)
        out = dataclasses.replace(out, activation_checkpointing=ac)
    if "mb" in changes:
        out = dataclasses.replace(out, train=dataclasses.replace(out.train, micro_batch_size=changes["mb"]))
    if "offload" in changes:
        out = dataclasses.replace(out, train=dataclasses.replace(out.train, optimizer_offload=changes["offload"]))
    if "chunk" in changes:
        out = dataclasses.replace(out, train=dataclasses.replace(out.train, loss_chunk_tokens=changes["chunk"]))
    return out


def neighbours(recipe: RecipeConfig) -> list[Candidate]:
    """The recipe itself, then each one-choice change of it."""
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
    # built-in AdamW), the loss chunked or not.
    for other in ("none", "states", "full"):
        if other != recipe.train.optimizer_offload and (other != "states" or recipe.train.optimizer is None):
            add(f"optimizer_offload {other}", offload=other)
    chunk = 0 if recipe.train.loss_chunk_tokens else 1024
    add(f"loss_chunk_tokens {chunk}", chunk=chunk)
    return out


def run_sweep(base: Simulation, *, gpus: list[GpuSpec], options: SimulationOptions) -> int:
    """Print the recipe's neighbours that fit, fastest first, and why the others do not. ``base`` is the recipe's own
    depth-scaled dry run (its errors reach the caller, which prints them as every plan error)."""
    world = base.layout.world_size
    candidates = neighbours(base.recipe)
    for candidate in candidates:
        try:
            layout = validate_recipe(candidate.recipe, world_size=world)
            simulation = base if candidate.own else simulate_scaled(candidate.recipe, layout, options)
            candidate.report = PlanReport.build(simulation, gpus)
        except ConfigError as exc:
            candidate.rejected = "invalid: " + " ".join(str(exc).split())[:160]
        except SimulationError as exc:
            candidate.rejected = "dry run failed: " + str(exc)[:160]
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
