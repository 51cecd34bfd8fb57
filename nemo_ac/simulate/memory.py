"""Per-rank memory of a step: torch's ``FSDPMemTracker`` for the peak and its breakdown, plus what it cannot see.

``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``) follows every storage an op creates, by category
(sharded / unsharded parameters, gradients, optimizer state, FSDP's all-gather and reduce-scatter buffers,
activations, backward temporaries, inputs) and keeps the peak and its breakdown; it works on real and fake tensors
alike. Two things are added here:

- it refuses a module called twice per iteration (gradient accumulation); ``after_micro_batch`` clears its
  per-module statistics after each micro batch, which keeps the global peak (all this report reads);
- EP all-to-all and CP collective outputs are activations or temporaries to it: ``StepCounter`` keeps their live
  bytes, sampled here whenever the tracker's total reaches a new peak, and reported as "of which".

Not seen by any tracker and added by hand when present (``HandAdded``): DeepEP's communication buffers, allocated
by deep_ep outside torch's allocator; the device copies FSDP2 stages a host shard through (``train.optimizer_offload:
full``; in the dry run the host is the simulated device, so its copies are no-ops the tracker cannot see).

``train.optimizer_offload: full`` on a GPU plan: the tracker's sharded parameters, sharded gradients and optimizer
states (``HOST_CATEGORIES``) are in host memory; the sampler leaves them out of the device's total.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# What FSDP2's CPUOffloadPolicy keeps in host memory, by FSDPMemTracker category (buffers stay on the device).
HOST_CATEGORIES = frozenset({"Sharded Param", "Sharded Grad", "OptState"})

# FSDPMemTracker's categories (their printed names) -> the report's terms.
TERMS: dict[str, str] = {
    "Sharded Param": "parameters",
    "Buffer": "parameters",
    "Unsharded Param": "gathered parameters",
    "All Gather": "all-gather buffers",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Reduce Scatter": "reduce-scatter buffers",
    "OptState": "optimizer states",
    "Activation": "activations",
    "Temp": "temporaries",
    "Inputs": "inputs",
}


@dataclass(frozen=True)
class HandAdded:
    term: str
    bytes: int
    why: str


@dataclass
class PeakMemory:
    """The peak of the tracked device and what it was made of."""

    peak_bytes: int = 0
    terms: dict[str, int] = field(default_factory=dict)
    comm_bytes_at_peak: int = 0  # EP / CP collective outputs alive at the peak (inside activations / temporaries)
    phase_at_peak: str = ""
    hand_added: list[HandAdded] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + sum(h.bytes for h in self.hand_added)

    def largest_terms(self, count: int = 3) -> list[tuple[str, int]]:
        terms = dict(self.terms)
        for extra in self.hand_added:
            terms[extra.term] = terms.get(extra.term, 0) + extra.bytes
        return sorted(terms.items(), key=lambda kv: -kv[1])[:count]


def _device_totals(
    snapshot: dict[Any, dict[Any, int]], device_type: str, host_categories: frozenset[str] = frozenset()
) -> dict[str, int]:
    """One device type's snapshot as {category name: bytes} (offloaded copies live on another device: not here),
    without ``host_categories`` (kept in host memory on the planned GPU); ``Total`` is what remains."""
    out: dict[str, int] = {}
    for device, categories in snapshot.items():
        if torch.device(device).type != device_type:
            continue
        for key, value in categories.items():
            name = str(getattr(key, "value", key))
            out[name] = out.get(name, 0) + int(value)
    for name in host_categories:
        out["Total"] = out.get("Total", 0) - out.pop(name, 0)
    return out


class PeakSampler:
    """Owns the tracker (torch's, keeping only its global peak: ``workarounds.mem_tracker_global_peak``) and keeps
    the peak of each phase (forward, backward, recompute, optimizer) with its breakdown and the live communication
    buffers ``context()`` reports then; ``peak`` is the largest of them. Per phase, because a depth-scaled dry run
    scales each phase's peak on its own: where the peak falls can move with depth (GLM-4.5-Air: backward at 2
    blocks, the optimizer step at 46)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        device_type: str,
        context: Callable[[], tuple[int, str]] = lambda: (0, ""),
        host_categories: frozenset[str] = frozenset(),
        sequence: Callable[[], int] | None = None,
    ) -> None:
        """``sequence``: the counter's running op number; given, the sampler also keeps ``timeline``, the device's
        memory by term over the step (what ``nemo-ac plan --memory-plot`` draws), one sample per op at most and
        only where the total moved by more than 0.2% of the peak so far."""
        from nemo_ac.workarounds.mem_tracker_global_peak import GlobalPeakFSDPMemTracker

        self.tracker = GlobalPeakFSDPMemTracker(model, optimizer, on_update=self._on_update)
        self.device_type = device_type
        self.host_categories = host_categories
        self.context = context
        self.optimizer = optimizer
        self._state_bytes: int | None = None
        self.phase_peaks: dict[str, PeakMemory] = {}
        self.sequence = sequence
        self.timeline: list[tuple[int, str, dict[str, int]]] = []  # (op number, phase, {term: bytes})
        self._highest = 0

    @property
    def peak(self) -> PeakMemory:
        if not self.phase_peaks:
            return PeakMemory()
        return max(self.phase_peaks.values(), key=lambda p: p.peak_bytes)

    def __enter__(self) -> PeakSampler:
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)

    def after_micro_batch(self) -> None:
        self.tracker.reset_mod_stats()

    def _on_update(self, snapshot: dict[Any, dict[Any, int]]) -> None:
        totals = _device_totals(snapshot, self.device_type, self.host_categories)
        total = totals.get("Total", 0)
        comm_bytes, phase = self.context()
        if self.sequence is not None:
            self._sample(total, phase, totals)
        best = self.phase_peaks.get(phase)
        if best is not None and total <= best.peak_bytes:
            return
        terms = _terms(totals)
        # The tracker files everything the optimizer step allocates as optimizer state; what exceeds the state
        # tensors themselves are the step's temporaries (foreach AdamW: a copy of exp_avg_sq's square root).
        if self._state_bytes is None:  # the states exist before the tracked step and keep their size
            on_host = "OptState" in self.host_categories
            self._state_bytes = 0 if on_host else optimizer_state_bytes(self.optimizer, self.device_type)
        states = self._state_bytes
        if terms.get("optimizer states", 0) > states:
            terms["optimizer step temporaries"] = terms["optimizer states"] - states
            terms["optimizer states"] = states
        self.phase_peaks[phase] = PeakMemory(
            peak_bytes=total, terms=terms, comm_bytes_at_peak=comm_bytes, phase_at_peak=phase
        )

    def _sample(self, total: int, phase: str, totals: dict[str, int]) -> None:
        seq = self.sequence() if self.sequence is not None else 0
        self._highest = max(self._highest, total)
        if self.timeline:
            last_seq, _, last = self.timeline[-1]
            moved = abs(total - sum(last.values()))
            if total < self._highest and moved <= self._highest // 500:
                return
            if last_seq == seq:
                self.timeline.pop()
        self.timeline.append((seq, phase, _terms(totals)))


def _terms(totals: dict[str, int]) -> dict[str, int]:
    terms: dict[str, int] = {}
    for name, value in totals.items():
        if name != "Total":
            term = TERMS.get(name, name)
            terms[term] = terms.get(term, 0) + value
    return terms


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, device_type: str) -> int:
    """Bytes of this rank's optimizer state tensors on ``device_type`` (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            storage = local.untyped_storage()
            if local.device.type == device_type and id(storage) not in seen:
                seen.add(id(storage))
                total += storage.nbytes()
    return total


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's storages under ``tensors`` (local shards of DTensors; a shared storage once)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if id(storage) not in seen:
            seen.add(id(storage))
            total += storage.nbytes()
    return total


def host_bytes(
    optimizer: torch.optim.Optimizer,
    offloader: Any,
    micro_batches_run: int,
    *,
    model: nn.Module | None = None,
    parameters_on_host: bool = False,
) -> dict[str, int]:
    """Host memory per rank by term: the moments ``train.optimizer_offload: states`` keeps there; with ``full``
    (``parameters_on_host``, ``model`` given) the sharded parameters, their gradients (one per trainable
    parameter: FSDP2 keeps the sharded gradients in the parameters' dtype) and every optimizer state; and the
    activations one micro batch offloads (all of them are on the host at the end of its forward). The dry run and
    the measured step report the same terms (``nemo_ac.simulate.accuracy`` compares them)."""
    from nemo_ac.trainer.host_optimizer_states import AdamWHostStates

    out = {}
    if parameters_on_host and model is not None:
        out["parameters"] = local_bytes(model.parameters())
        out["gradients"] = local_bytes(p for p in model.parameters() if p.requires_grad)
        out["optimizer states"] = optimizer_state_bytes(optimizer, "cpu")
    if isinstance(optimizer, AdamWHostStates):
        out["optimizer states"] = optimizer.host_state_bytes()
    if offloader is not None and offloader.stats.packed_bytes:
        out["offloaded activations"] = offloader.stats.packed_bytes // max(micro_batches_run, 1)
    return out
