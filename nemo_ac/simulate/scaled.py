"""A dry run at real width but reduced depth, scaled to the real depth: ``nemo-ac plan --depth scaled``.

A model's blocks come in a few kinds (nemotron_h: Mamba-2, MoE, attention, dense; qwen3_5_moe: Gated DeltaNet and
attention, each with MoE, plus vision blocks; glm4_moe / qwen3_moe: dense first layers, then MoE). The base run
keeps one block of each kind, in the order they first appear; one more run per kind adds a second block of it
before the others, so that its saved activations are held through the backward of the rest as at full depth (added
after them, its backward ran first and the backward peak stayed where the base run had it: 58.6 GiB per rank scaled
against 120.9 full for Nemotron Super with uncheckpointed Mamba-2 blocks).
Every counted quantity (each memory term at the peak of each phase, FLOPs per phase, collective calls and bytes,
each op of the roofline) is then ``base + sum_k (n_k - 1) * (run_k - base)``, and the peak is the largest scaled
phase peak: exact for what grows block by block (parameters, gradients, optimizer states, FLOPs, bytes), an
approximation for activations held at a peak. Transient terms (FSDP buffers, gathered parameters, temporaries) are
one block's whatever the depth: they keep the largest value a run saw (``GROWS_WITH_DEPTH``).
The report says the numbers are scaled and from how many blocks.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

from nemo_ac.config.layout import ParallelLayout
from nemo_ac.config.schema import ModelConfig, RecipeConfig
from nemo_ac.simulate.memory import PeakMemory
from nemo_ac.simulate.run import Simulation, SimulationOptions, simulate, target_plan
from nemo_ac.simulate.step import StepMeasurement, combine

VISION = "vision block"


def block_kinds(model: ModelConfig) -> tuple[list[str], Counter[str]]:
    """The decoder's block kinds in order of first appearance, and how many blocks each has (vision included)."""
    if model.layer_pattern:
        order = list(dict.fromkeys(model.layer_pattern))
        counts = Counter(model.layer_pattern)
    elif 0 < model.first_k_dense_replace < model.num_layers:
        order = ["dense", "moe"]
        counts = Counter({"dense": model.first_k_dense_replace, "moe": model.num_layers - model.first_k_dense_replace})
    else:
        order = ["block"]
        counts = Counter({"block": model.num_layers})
    if model.vision.depth > 0:
        order.append(VISION)
        counts[VISION] = model.vision.depth
    return order, counts


def with_blocks(model: ModelConfig, kinds: list[str]) -> ModelConfig:
    """``model`` with the decoder blocks ``kinds`` (in this order; ``VISION`` entries set the vision depth)."""
    vision = sum(1 for kind in kinds if kind == VISION)
    decoder = [kind for kind in kinds if kind != VISION]
    changes: dict[str, object] = {"num_layers": len(decoder)}
    if model.layer_pattern:
        changes["layer_pattern"] = "".join(decoder)
    elif "dense" in decoder:
        changes["first_k_dense_replace"] = decoder.count("dense")
        decoder.sort(key=lambda kind: kind != "dense")  # dense layers come first
    if model.vision.depth > 0:
        changes["vision"] = dataclasses.replace(model.vision, depth=max(vision, 1))
    return dataclasses.replace(model, **changes)


# Terms that grow block by block: scaled. The others are transient and as large as one block's (buffers of the FSDP
# unit in flight, the gathered parameters of one or two units, a block's backward temporaries, the logits): kept at
# the largest any run saw.
GROWS_WITH_DEPTH = frozenset(
    {"parameters", "gradients", "optimizer states", "optimizer step temporaries", "activations", "inputs"}
)
# Without reshard after forward every unit keeps its gathered parameters from its forward to its backward: at a
# backward peak they are all there, so they grow with depth too (counted as one unit's, a 46-block model's peak was
# under-estimated by 45 units of gathered bf16 parameters).
GROWS_WITHOUT_RESHARD = GROWS_WITH_DEPTH | {"gathered parameters"}


def _scale_peak(
    base: PeakMemory, extra: list[tuple[PeakMemory, int]], *, grows: frozenset[str] = GROWS_WITH_DEPTH
) -> PeakMemory:
    terms = dict(base.terms)
    comm = base.comm_bytes_at_peak
    for run, times in extra:
        comm += times * (run.comm_bytes_at_peak - base.comm_bytes_at_peak)
        for term in set(terms) | set(run.terms):
            if term in grows:
                terms[term] = terms.get(term, 0) + times * (run.terms.get(term, 0) - base.terms.get(term, 0))
            else:
                terms[term] = max(terms.get(term, 0), run.terms.get(term, 0))
    terms = {k: max(v, 0) for k, v in terms.items()}
    return PeakMemory(
        peak_bytes=sum(terms.values()),
        terms=terms,
        comm_bytes_at_peak=max(comm, 0),
        phase_at_peak=base.phase_at_peak,
        hand_added=list(base.hand_added),
    )


def simulate_scaled(recipe: RecipeConfig, layout: ParallelLayout, options: SimulationOptions) -> Simulation:
    """The dry run from one block of each kind (module docstring)."""
    started = time.perf_counter()
    order, counts = block_kinds(recipe.model)
    base_recipe = dataclasses.replace(recipe, model=with_blocks(recipe.model, order))
    base = simulate(base_recipe, layout, options)
    runs: list[tuple[Simulation, int]] = []
    for kind in order:
        if counts[kind] > 1:
            more = dataclasses.replace(recipe, model=with_blocks(recipe.model, [kind, *order]))
            runs.append((simulate(more, layout, options), counts[kind] - 1))
    b = base.measurement
    parts = [(b.counts, 1 - sum(times for _, times in runs))]
    parts += [(run.measurement.counts, times) for run, times in runs]
    grows = GROWS_WITH_DEPTH if recipe.parallel.fsdp.reshard_after_forward else GROWS_WITHOUT_RESHARD
    phase_peaks = {
        phase: _scale_peak(
            peak, [(run.measurement.phase_peaks.get(phase, peak), times) for run, times in runs], grows=grows
        )
        for phase, peak in b.phase_peaks.items()
    }
    measurement = StepMeasurement(
        counts=combine(parts),
        peak=max(phase_peaks.values(), key=lambda p: p.peak_bytes) if phase_peaks else b.peak,
        micro_batches_run=b.micro_batches_run,
        micro_batches_per_step=b.micro_batches_per_step,
        phase_peaks=phase_peaks,
    )
    # Host memory grows block by block too (each block's offloaded states and activations).
    host_bytes = {
        term: max(value + sum(times * (run.host_bytes.get(term, 0) - value) for run, times in runs), 0)
        for term, value in base.host_bytes.items()
    }
    described = ", ".join(f"{counts[kind]} x {kind}" for kind in order)
    full, _, _ = target_plan(recipe, layout)
    return dataclasses.replace(
        base,
        recipe=recipe,
        plan=full,
        measurement=measurement,
        host_bytes=host_bytes,
        assumptions=[
            *base.assumptions,
            f"depth scaled: {1 + len(runs)} dry runs of {len(order)}-{len(order) + 1} blocks at real width, scaled to "
            f"{described} (exact for parameters, gradients, optimizer states, FLOPs and bytes; the peak's activations "
            "extrapolated per block)",
        ],
        wall_s=time.perf_counter() - started,
        peak_rss_bytes=max([base.peak_rss_bytes, *(run.peak_rss_bytes for run, _ in runs)]),
    )
