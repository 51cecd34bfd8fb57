"""Pictures of the estimated step: a Chrome / Perfetto trace (``nemo-ac plan --trace``) and memory over the step by
term (``--memory-plot``, a PNG).

The trace lays the counted step out on streams, each op and collective at its estimated duration (the estimate's
roofline, ``simulate.estimate``): the compute stream runs the ops in order; FSDP's all-gathers and reduce-scatters
run on their own stream from the moment they are issued, one after another; EP / CP collectives and the loop's
all-reduces run on the communication stream while compute waits for them (they block; DeepEP's asynchronous transfers
do not: the op that first reads their rows waits for them, and the compute between is not drawn slowed by the SMs
DeepEP holds); host-link copies run on the
host stream (activation offload's and FSDP's shard copies overlapped, the optimizer-phase ones and the update on
host memory blocking). Micro batches the dry run counted without running (they repeat the last one run) appear as one
slice per stream. Each stream's slices add up to the estimate's term for it (compute, FSDP, blocking collectives,
host). The trace's end can differ a little from the estimate's ``step_s``, which adds the
overlapped streams as ``max(compute, FSDP)`` rather than placing each call: the trace shows where an exposed
all-gather lands, the estimate's total is the figure the report prints.

The memory plot is the dry run's device memory by term (the tracker's categories) against the same timeline, its
peak marked; drawn with Pillow (the only image library nemo_ac's extras carry).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

from nemo_ac.simulate.counters import CollectiveCall, StepCounts
from nemo_ac.simulate.estimate import KERNEL_EFFICIENCY, call_seconds, cost_seconds
from nemo_ac.simulate.gpus import GpuSpec
from nemo_ac.simulate.op_cost import OpCost
from nemo_ac.simulate.report import seconds, size

STREAMS = {"compute": 1, "FSDP all-gather / reduce-scatter": 2, "EP / CP / loop collectives": 3, "host link": 4}
_US = 1e6


class _Timeline:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.free = dict.fromkeys(STREAMS, 0.0)
        self.clock = 0.0  # the compute stream's time

    def slice(self, stream: str, name: str, start: float, seconds: float, args: dict) -> float:
        self.events.append(
            {"name": name, "ph": "X", "pid": 1, "tid": STREAMS[stream], "ts": start * _US, "dur": seconds * _US,
             "args": args}
        )  # fmt: skip
        self.free[stream] = start + seconds
        return start + seconds

    def compute(self, name: str, seconds: float, args: dict) -> None:
        self.clock = self.slice("compute", name, self.clock, seconds, args)

    def side(self, stream: str, name: str, seconds: float, args: dict, *, blocking: bool) -> None:
        end = self.slice(stream, name, max(self.clock, self.free[stream]), seconds, args)
        if blocking:
            self.clock = end


def _place_call(timeline: _Timeline, call: CollectiveCall, gpu: GpuSpec, reads: dict[int, float]) -> None:
    """Place ``call``; an asynchronous one (``read_at``) leaves the compute stream running and ``reads`` holds when
    the op that first reads its output may start."""
    seconds = call_seconds(call, gpu=gpu)
    args = {"group": call.label, "bytes sent": call.wire_bytes, "phase": call.phase}
    if call.network_bytes:
        args["bytes over RDMA"] = call.network_bytes
    name = f"{call.kind} ({call.label})"
    if call.overlapped:
        timeline.side("FSDP all-gather / reduce-scatter", name, seconds, args, blocking=False)
    elif call.read_at is not None and call.read_at > call.at:
        timeline.side("EP / CP / loop collectives", name + " async", seconds, args, blocking=False)
        reads[call.read_at] = max(reads.get(call.read_at, 0.0), timeline.free["EP / CP / loop collectives"])
    else:
        timeline.side("EP / CP / loop collectives", name, seconds, args, blocking=True)


def _place_cost(timeline: _Timeline, cost: OpCost, seconds: float) -> None:
    args = {"phase": cost.phase, "flops": cost.flops, "bytes": cost.fused_bytes}
    if cost.link in ("host", "host_blocking", "host_memory"):
        blocking = cost.link != "host" or cost.phase == "optimizer"
        timeline.side("host link", cost.name, seconds, args, blocking=blocking)
    else:
        timeline.compute(cost.name, seconds, args)


def step_timeline(
    counts: StepCounts, *, gpu: GpuSpec, kernel_efficiency: float = KERNEL_EFFICIENCY
) -> tuple[dict, list[tuple[int, float]]]:
    """The trace (Chrome trace-event JSON) and the (op number, start second) of every placed op."""
    timeline = _Timeline()
    starts: list[tuple[int, float]] = []
    replayed = len(counts.costs) if counts.replayed_from is None else counts.replayed_from
    calls_at: dict[int, list[CollectiveCall]] = {}
    repeated_calls: list[CollectiveCall] = []
    for call in counts.calls:
        if call.at < replayed or (call.at == replayed and call.phase == "optimizer"):
            calls_at.setdefault(call.at, []).append(call)
        else:
            repeated_calls.append(call)
    ran = list(enumerate(counts.costs[:replayed]))
    run = [(i, c) for i, c in ran if c.seq and c.phase != "optimizer"]
    update = [(i, c) for i, c in ran if c.seq and c.phase == "optimizer"]
    summarized = [c for i, c in ran if not c.seq] + counts.costs[replayed:]

    reads: dict[int, float] = {}  # cost index -> when the async transfer it reads first has arrived

    def place(items: Sequence[tuple[int, OpCost]]) -> None:
        for index, cost in items:
            for call in calls_at.pop(index, []):
                _place_call(timeline, call, gpu, reads)
            timeline.clock = max(timeline.clock, reads.pop(index, 0.0))
            starts.append((cost.seq, timeline.clock))
            _place_cost(timeline, cost, cost_seconds(cost, gpu=gpu, kernel_efficiency=kernel_efficiency))

    place(run)
    repeats = max((c.weight for c in counts.costs[replayed:]), default=1)
    label = f"{repeats} more micro batches (as the last one run)"
    counted = {"counted, not run": True}
    compute = sum(cost_seconds(c, gpu=gpu, kernel_efficiency=kernel_efficiency) for c in summarized if not c.link)
    if compute:
        timeline.compute(label, compute, counted)
    for overlapped, stream in ((True, "FSDP all-gather / reduce-scatter"), (False, "EP / CP / loop collectives")):
        seconds = sum(call_seconds(c, gpu=gpu) * c.weight for c in repeated_calls if c.overlapped is overlapped)
        if seconds:
            timeline.side(stream, label, seconds, counted, blocking=not overlapped)
    for cost in (c for c in summarized if c.link):  # hand-added host costs (train.optimizer_offload: full)
        _place_cost(timeline, cost, cost_seconds(cost, gpu=gpu, kernel_efficiency=kernel_efficiency))
    place(update)
    for leftover in calls_at.values():
        for call in leftover:
            _place_call(timeline, call, gpu, reads)
    metadata = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"nemo-ac plan: estimated step on {gpu.name}"}}
    ] + [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}} for name, tid in
         STREAMS.items()]  # fmt: skip
    end = max([timeline.clock, *timeline.free.values()])
    trace = {
        "traceEvents": metadata + timeline.events,
        "displayTimeUnit": "ms",
        "otherData": {"estimate": True, "gpu": gpu.name, "end_s": end},
    }
    return trace, starts


# Memory plot: the report's terms grouped into the categories drawn, bottom to top.
PLOT_GROUPS: dict[str, tuple[str, ...]] = {
    "parameters": ("parameters", "gathered parameters"),
    "gradients": ("gradients",),
    "optimizer": ("optimizer states", "optimizer step temporaries"),
    "activations": ("activations", "inputs"),
    "temporaries": ("temporaries",),
    "buffers": ("all-gather buffers", "reduce-scatter buffers"),
}
COLORS = {
    "parameters": (66, 133, 244),
    "gradients": (219, 68, 55),
    "optimizer": (244, 180, 0),
    "activations": (15, 157, 88),
    "temporaries": (171, 71, 188),
    "buffers": (0, 172, 193),
}


def memory_series(
    timeline: Sequence[tuple[int, str, dict[str, int]]], starts: Sequence[tuple[int, float]]
) -> list[tuple[float, dict[str, int]]]:
    """The sampler's (op number, phase, terms) placed at the trace's time of that op, grouped as ``PLOT_GROUPS``."""
    seqs = [seq for seq, _ in starts]
    out = []
    for seq, _, terms in timeline:
        index = bisect.bisect_right(seqs, seq) - 1
        if index < 0:
            continue
        grouped = {group: sum(terms.get(t, 0) for t in members) for group, members in PLOT_GROUPS.items()}
        other = sum(terms.values()) - sum(grouped.values())
        grouped["temporaries"] += other  # any term not named above
        out.append((starts[index][1], grouped))
    return out


def replayed_spans(trace: dict) -> list[tuple[float, float, str]]:
    """(start s, end s, name) of the compute slices the dry run counted without running them."""
    return [
        (e["ts"] / _US, (e["ts"] + e["dur"]) / _US, e["name"])
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["tid"] == STREAMS["compute"] and e["args"].get("counted, not run")
    ]


def write_memory_plot(
    path: str | Path,
    series: list[tuple[float, dict[str, int]]],
    *,
    title: str,
    replayed: Sequence[tuple[float, float, str]] = (),
) -> None:
    """A stacked area chart of ``series`` (seconds, bytes by group), the peak marked, as a PNG; ``replayed`` spans
    (micro batches counted, not run: no samples) are labelled."""
    from PIL import Image, ImageDraw

    width, height, left, bottom, top, right = 1200, 520, 70, 50, 40, 180
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    plot_w, plot_h = width - left - right, height - top - bottom
    end = max((t for t, _ in series), default=1.0) or 1.0
    totals = [sum(g.values()) for _, g in series]
    peak = max(totals, default=1) or 1

    def x(t: float) -> float:
        return left + plot_w * t / end

    def y(b: float) -> float:
        return top + plot_h * (1 - b / peak)

    for (t0, groups), (t1, _) in zip(series, [*series[1:], (end, {})], strict=True):
        base = 0
        for group in PLOT_GROUPS:
            value = groups.get(group, 0)
            if value > 0:
                draw.rectangle([x(t0), y(base + value), max(x(t1), x(t0) + 1), y(base)], fill=COLORS[group])
            base += value
    at = totals.index(peak) if totals else 0
    if series:
        px = x(series[at][0])
        draw.line([px, top, px, top + plot_h], fill=(0, 0, 0), width=1)
        draw.text((px + 4, top + 2), f"peak {size(peak)}", fill=(0, 0, 0))
    for start, stop, name in replayed:
        draw.rectangle([x(start), top, x(stop), top + 14], fill=(235, 235, 235))
        draw.text((x(start) + 4, top + 2), f"{name}: counted, not sampled", fill=(0, 0, 0))
    draw.rectangle([left, top, left + plot_w, top + plot_h], outline=(0, 0, 0))
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        draw.text((4, y(peak * fraction) - 6), size(peak * fraction), fill=(0, 0, 0))
        draw.text((x(end * fraction) - 12, top + plot_h + 6), seconds(end * fraction), fill=(0, 0, 0))
    draw.text((left, 10), title, fill=(0, 0, 0))
    draw.text(
        (left, height - 20), "estimated time (the trace's timeline; an estimate, not a measurement)", fill=(0, 0, 0)
    )
    for row, group in enumerate(PLOT_GROUPS):
        draw.rectangle(
            [width - right + 16, top + 20 * row, width - right + 30, top + 20 * row + 12], fill=COLORS[group]
        )
        draw.text((width - right + 36, top + 20 * row), group, fill=(0, 0, 0))
    image.save(str(path))
