"""Counted training steps: the trainer's own forward / backward / update under the counters, real or fake alike.

``measure_steps`` drives ``Trainer.accumulate`` and ``Trainer.update`` (the code every run executes) over prepared
micro batches while ``StepCounter`` and the memory sampler watch. A dry run calls it under FakeTensorMode with a
fake process group; the accuracy tests call it in a real gloo run, so prediction and measurement differ only in
what they run on.

At full size a step may hold many micro batches (the Qwen3.6 recipe: 8). ``start_like_a_later_step`` first allocates
what every later step holds from its start (optimizer state, and the sharded gradients micro batches accumulate
into), so one step shows the steady state, and one micro batch of it stands for every other (same shapes under the
dry run's data assumption, gradients already allocated): ``micro_batch_limit`` runs the first ``limit`` and counts
the last one run again for each left out; the report says so.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nemo_ac.simulate.counters import StepCounter, StepCounts
from nemo_ac.simulate.memory import PeakMemory, PeakSampler
from nemo_ac.trainer.loop import PreparedBatch, Trainer


@dataclass
class StepMeasurement:
    counts: StepCounts  # the whole step (micro batches left out counted as the last one run)
    peak: PeakMemory
    micro_batches_run: int
    micro_batches_per_step: int
    phase_peaks: dict[str, PeakMemory] = field(default_factory=dict)  # the peak of each phase (depth scaling)
    timeline: list[tuple[int, str, dict[str, int]]] = field(default_factory=list)  # PeakSampler.timeline


def combine(parts: Sequence[tuple[StepCounts, int]]) -> StepCounts:
    """Counts of several segments, each taken ``times`` times (a negative ``times`` subtracts: depth scaling)."""
    out = StepCounts()
    for part, times in parts:
        if times == 0:
            continue
        out.ops += part.ops * times
        for phase, value in part.flops.items():
            out.flops[phase] += value * times
        for name, value in part.without_formula.items():
            out.without_formula[name] += value * times
        for key, record in part.collectives.items():
            mine = out.collectives.setdefault(key, type(record)(ranks=record.ranks))
            mine.calls += record.calls * times
            mine.payload_bytes += record.payload_bytes * times
            mine.wire_bytes += record.wire_bytes * times
            mine.network_bytes += record.network_bytes * times
        offset = len(out.costs)
        out.calls.extend(
            dataclasses.replace(c, at=c.at + offset, read_at=c.read_at + offset if c.read_at is not None else None,
                                weight=c.weight * times)
            for c in part.calls
        )  # fmt: skip
        out.costs.extend(
            part.costs if times == 1 else [dataclasses.replace(c, weight=c.weight * times) for c in part.costs]
        )
    out.without_formula = defaultdict(int, {k: v for k, v in out.without_formula.items() if v > 0})
    out.collectives = {k: r for k, r in out.collectives.items() if r.calls > 0}
    return out


def start_like_a_later_step(trainer: Trainer, *, hold_gradients: bool) -> None:
    """Allocate what any step after the first holds from its start, so that one counted step shows the steady
    state: the optimizer's state (one update with zero gradients: AdamW creates ``exp_avg`` / ``exp_avg_sq`` on its
    first step) and, when ``hold_gradients`` (a step of several micro batches: from the second one on, FSDP2
    accumulates into the sharded gradients the first one made), zero sharded gradients. Call before the memory
    tracker enters: it picks these up as optimizer states and gradients."""
    for param in trainer.params:
        param.grad = torch.zeros_like(param)
    trainer.optimizer.step()
    if not hold_gradients:
        trainer.optimizer.zero_grad(set_to_none=True)


def measure_step(
    trainer: Trainer,
    prepared: Sequence[PreparedBatch],
    *,
    global_tokens: int,
    counter: StepCounter,
    sampler: PeakSampler,
    micro_batch_limit: int | None = None,
) -> StepMeasurement:
    """One training step of ``trainer`` over this rank's ``prepared`` micro batches (built outside any fake mode)
    under ``counter`` and ``sampler`` (both entered by the caller, the sampler below the counter). With
    ``micro_batch_limit`` the first ``limit`` micro batches run and the last one run is counted again for each
    micro batch left out (module docstring)."""
    total = len(prepared)
    run = total if micro_batch_limit is None else max(1, min(total, micro_batch_limit))
    segments: list[StepCounts] = []

    def after_micro_batch(_: int) -> None:
        sampler.after_micro_batch()
        segments.append(counter.counts)
        counter.reset()

    counter.reset()
    sums = trainer.accumulate(prepared[:run], global_tokens=global_tokens, after_micro_batch=after_micro_batch)
    with counter.phase("optimizer"):
        trainer.update()
        trainer.step += 1
        for callback in trainer.options.post_step_callbacks:
            callback(trainer.step, {"expert_load": sums.expert_load})
    update = counter.counts
    counter.reset()
    parts = [(segment, 1) for segment in segments] + [(update, 1)]
    replayed_from = sum(len(part.costs) for part, _ in parts)
    if run < total:
        parts.append((segments[-1], total - run))
    counts = combine(parts)
    counts.replayed_from = replayed_from if run < total else None
    return StepMeasurement(
        counts=counts,
        peak=sampler.peak,
        micro_batches_run=run,
        micro_batches_per_step=total,
        phase_peaks=dict(sampler.phase_peaks),
        timeline=list(sampler.timeline),
    )
