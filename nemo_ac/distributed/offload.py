"""Activation offloading (``activation_checkpointing.offload: true``): what autograd saves in a decoder block's
forward goes to host memory and comes back for backward.

How. Every decoder block (the AC wrapper when there is one) gets a forward pre-hook that enters
``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` and an ``always_call`` forward hook that leaves it, so
every tensor autograd saves while the block runs passes through ``pack``. What that is depends on the AC mode:

- ``full``: the checkpoint saves only the block's inputs (``torch.utils.checkpoint`` keeps them with
  ``save_for_backward`` *outside* its own hooks; everything inside the region is dropped and recomputed), so the one
  activation full AC keeps per block is what moves to the host. Recompute in backward unpacks it first.
- ``none``: everything the block saves (matmul inputs, attention outputs, ...) moves.
- ``selective`` is rejected by validation: SAC keeps the op outputs its policy saves in torch's SAC cache, which
  saved-tensor hooks never see, so only the block inputs would move.

Where to. On CUDA, ``pack`` copies into pinned host memory on a side stream (after waiting for the compute
stream) and records an event; the device tensor is kept (not ``record_stream``: that frees memory whenever the
allocator next looks, so the device footprint would depend on timing). ``unpack`` makes the current stream wait for
the copy back and returns it. On CPU the compute device *is* host memory, so ``pack`` copies into a separate host
buffer and drops the reference to the original; the counters (tensors and bytes packed, copies brought back,
copies prefetched) make the work observable, and tests check values and losses against a run without offloading.
Parameters (and views of them, such as a transposed weight saved by ``mm``) are never copied: they stay alive
anyway (FSDP2 re-gathers them for backward), so moving them would cost bandwidth and free nothing. A tensor saved
several times in one block (``x`` feeding q, k and v projections) is copied once (and brought back once). Tensors
smaller than ``min_bytes`` stay where they are. Copies keep the saved tensor's strides (views with gaps included)
and its address modulo 256 bytes: GEMMs choose kernels by leading dimension and alignment, and a contiguous or
differently aligned copy changed the last bits of gradients (measured on CPU with MKL); with both kept, offloading
is bitwise invisible to the result.

Blocks in flight (``activation_checkpointing.offload_in_flight``, N; prime-rl's ``max_inflight_activations``
counts tensors, this counts blocks). Unbounded, the copies queue on the side stream behind a compute stream that
runs ahead, and every block whose copies have not finished still holds its device memory: a slow host link turns
offloading into no saving at all. So, in forward, block i starts only after the compute stream has waited for the
copies of block i-N, whose device tensors are released then: at most N blocks' saved tensors are on the device at
once (the block running and N-1 before it). Backward begins a block when the gradient of its output is complete (a
hook on that output); then the copies back of the N-1 blocks before it start on the side stream (prefetch), so
they arrive while this block's backward runs, and again at most N blocks' tensors are on the device. N = 1: no
overlap across blocks; each block's tensors come back on the compute stream when autograd asks for them. The dry
run of a GPU plan (``accounting_host`` "meta") holds the device tensors exactly as long (as if each copy took its
whole window: the most the run can hold) and counts the copies made on demand as on the compute stream.

Validation rejects ``offload`` with ``compile.enabled`` (not verified: compiled blocks save inside their compiled
autograd function) and with ``mode: selective`` (above). Vision-tower blocks are not offloaded.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nemo_ac.distributed.blocks import decoder_layers


@dataclass
class OffloadStats:
    """Cumulative counts since install (or the last ``reset``)."""

    packed: int = 0  # tensors copied to host memory
    packed_bytes: int = 0
    unpacked: int = 0  # saved tensors handed back to autograd
    deduplicated: int = 0  # saves of a tensor already copied in the same block invocation
    kept: int = 0  # saves left in place (parameters, tiny tensors)
    prefetched: int = 0  # copies brought back ahead of use (while a later block's backward ran)
    fetched_on_demand: int = 0  # copies brought back when autograd asked for them (on the compute stream)
    most_blocks_held: int = 0  # the most blocks whose offloaded tensors were held on the device at once

    def as_metrics(self) -> dict[str, float]:
        return {"offload_tensors": self.packed, "offload_mib": round(self.packed_bytes / 2**20, 3)}


@dataclass(eq=False)
class _Packed:
    """A host copy and how to bring it back (autograd restores requires_grad / grad_fn itself on unpack)."""

    host: torch.Tensor
    device: torch.device
    address_mod: int  # the original's address modulo _ALIGN_BYTES, reproduced by the copy back
    event: Any = None  # torch.cuda.Event on CUDA: the copy to the host is done
    back: torch.Tensor | None = None  # the copy brought back (prefetched or on demand), shared by every unpack
    back_event: Any = None  # CUDA: a prefetched copy back is done


@dataclass
class _Kept:
    tensor: torch.Tensor


@dataclass(eq=False)
class _Invocation:
    """One block forward: tensors already copied (weak reference check against id reuse), the device tensors held
    until their copies are known to be done, and the copies in order for the backward's prefetch."""

    seen: dict[int, tuple[weakref.ref, _Packed]] = field(default_factory=dict)
    originals: list[torch.Tensor] = field(default_factory=list)
    last_event: Any = None  # CUDA: recorded after the block's last copy to the host
    packed: list[weakref.ref[_Packed]] = field(default_factory=list)


# A copy back made where autograd asks for it runs on the compute stream; the dry run's counter reads this to put it
# on the step's critical path (simulate.counters), a prefetched one it counts as overlapped.
_copy_state = threading.local()


def copying_on_compute_stream() -> bool:
    """Whether the host-link copy being made now is on the compute stream (an on-demand copy back)."""
    return getattr(_copy_state, "on_compute_stream", False)


@contextlib.contextmanager
def _on_compute_stream() -> Iterator[None]:
    _copy_state.on_compute_stream = True
    try:
        yield
    finally:
        _copy_state.on_compute_stream = False


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter)


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The block output whose gradient marks the start of the block's backward: the first floating tensor that
    requires grad (decoder blocks return the hidden states, alone or first in a tuple)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None


# Copies keep the original's address modulo this many bytes: CPU GEMMs (MKL) and GPU kernels choose code paths by
# pointer alignment, and a differently aligned copy would change the last bits of the gradients.
_ALIGN_BYTES = 256


def _copy_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """``tensor``'s own strides when no two elements share memory (dense, or a view with gaps such as one half of a
    fused projection), else contiguous ones (expanded tensors: a copy cannot write overlapping memory)."""
    dims = sorted((st, n) for n, st in zip(tensor.shape, tensor.stride(), strict=True) if n > 1)
    reach = 1
    for stride, size in dims:
        if stride < reach:
            return torch.empty(tensor.shape, device="meta").stride()
        reach = stride * size
    return tensor.stride()


def _empty_like_aligned(
    tensor: torch.Tensor, *, device: torch.device | str, address_mod: int, pin_memory: bool = False
) -> torch.Tensor:
    """An empty tensor with ``tensor``'s shape and (non-overlapping) strides, placed in a fresh buffer so that its
    address modulo ``_ALIGN_BYTES`` is ``address_mod`` (the original's). Same strides and alignment keep backward
    bitwise equal to a run without offloading: GEMMs pick their code path by leading dimension and alignment."""
    strides = _copy_strides(tensor)
    span = 1 + sum((n - 1) * st for n, st in zip(tensor.shape, strides, strict=True))
    size = tensor.element_size()
    flat = torch.empty(_ALIGN_BYTES // size + span, dtype=tensor.dtype, device=device, pin_memory=pin_memory)
    pad = ((address_mod - flat.data_ptr()) % _ALIGN_BYTES) // size
    return flat.as_strided(tensor.shape, strides, pad)


class ActivationOffloader:
    """The saved-tensor hook pair and its bookkeeping; one per model."""

    def __init__(self, *, min_bytes: int = 1024, in_flight: int = 2) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight={in_flight}: at least the running block's tensors are on the device")
        self.min_bytes = min_bytes
        self.in_flight = in_flight
        # Where a copy goes when it only has to leave the device's memory accounting: the dry run
        # (nemo_ac.simulate) sets "meta" (fake tensors have no address to align); None: host memory as above.
        self.accounting_host: str | None = None
        self.stats = OffloadStats()
        self._stream: Any = None
        # One entry per block forward in progress (blocks do not nest; a stack keeps enter/exit paired).
        self._invocations: list[_Invocation] = []
        self._active: list[torch.autograd.graph.saved_tensors_hooks] = []
        # Finished block forwards whose device tensors are still held (their copies may be in flight), oldest first.
        self._held: deque[_Invocation] = deque()
        # Block forwards that copied something, in order, whose backward has not begun (the prefetch's queue).
        self._order: list[_Invocation] = []

    # ---- saved-tensor hooks -----------------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> _Packed | _Kept:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_bytes or _is_parameter(tensor) or tensor.layout != torch.strided:
            self.stats.kept += 1
            return _Kept(tensor)
        invocation = self._invocations[-1] if self._invocations else None
        if invocation is not None:
            hit = invocation.seen.get(id(tensor))
            if hit is not None and hit[0]() is tensor:
                self.stats.deduplicated += 1
                return hit[1]
        packed = self._copy_to_host(tensor, invocation)
        self.stats.packed += 1
        self.stats.packed_bytes += nbytes
        if invocation is not None:
            invocation.seen[id(tensor)] = (weakref.ref(tensor), packed)
            invocation.packed.append(weakref.ref(packed))
        return packed

    def unpack(self, packed: _Packed | _Kept) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        self.stats.unpacked += 1
        if packed.back is None:
            self.stats.fetched_on_demand += 1
            packed.back = self._bring_back(packed, ahead=False)
        elif packed.back_event is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.back_event)
            packed.back_event = None
        return packed.back

    def _bring_back(self, packed: _Packed, *, ahead: bool) -> torch.Tensor:
        """The device copy of ``packed``: on the side stream when ``ahead`` (a prefetch; ``unpack`` waits for its
        event), else on the compute stream."""
        if self.accounting_host is not None:
            if ahead:
                return packed.host.to(packed.device)
            with _on_compute_stream():
                return packed.host.to(packed.device)
        if packed.device.type != "cuda":
            return packed.host  # CPU: the host buffer is what backward reads
        compute = torch.cuda.current_stream(packed.device)
        # Allocated on the compute stream, which later reads and frees it.
        device_copy = _empty_like_aligned(packed.host, device=packed.device, address_mod=packed.address_mod)
        if not ahead:
            compute.wait_event(packed.event)
            return device_copy.copy_(packed.host, non_blocking=True)
        side = self._side_stream(packed.device)
        side.wait_stream(compute)  # the allocation above happens before the copy writes it
        with torch.cuda.stream(side):
            device_copy.copy_(packed.host, non_blocking=True)
            packed.back_event = torch.cuda.Event()
            packed.back_event.record(side)
        return device_copy

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _copy_to_host(self, tensor: torch.Tensor, invocation: _Invocation | None) -> _Packed:
        if self.accounting_host is not None:
            if self.accounting_host == "meta" and invocation is not None:
                invocation.originals.append(tensor)  # a GPU plan: held until its window closes, as on the GPU
            return _Packed(host=tensor.detach().to(self.accounting_host), device=tensor.device, address_mod=0)
        address_mod = tensor.data_ptr() % _ALIGN_BYTES
        if tensor.device.type == "cuda":
            side = self._side_stream(tensor.device)
            host = _empty_like_aligned(tensor, device="cpu", address_mod=address_mod, pin_memory=True)
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            if invocation is not None:
                # Held until the compute stream has waited for this event (_release_held): only then may the
                # allocator hand the memory to a kernel on the compute stream.
                invocation.originals.append(tensor)
                invocation.last_event = event
            else:
                tensor.record_stream(side)
            return _Packed(host=host, device=tensor.device, address_mod=address_mod, event=event)
        host = _empty_like_aligned(tensor, device="cpu", address_mod=address_mod)
        host.copy_(tensor.detach())
        return _Packed(host=host, device=tensor.device, address_mod=address_mod)

    def _release_held(self, *, keep: int) -> None:
        """Wait (on the compute stream) for the copies of all but the ``keep`` newest held block forwards, then
        drop their device tensors."""
        while len(self._held) > keep:
            invocation = self._held.popleft()
            if invocation.last_event is not None:
                torch.cuda.current_stream(invocation.originals[0].device).wait_event(invocation.last_event)
            invocation.originals.clear()

    def _backward_begins(self, invocation: _Invocation) -> None:
        """The gradient of this block's output is complete: its backward starts now. Every copy to the host is done
        by then; the copies back of the ``in_flight - 1`` blocks before it start on the side stream."""
        self._release_held(keep=0)
        position = next((i for i, entry in enumerate(self._order) if entry is invocation), None)
        if position is None:
            return
        ahead = self._order[max(0, position - (self.in_flight - 1)) : position]
        del self._order[position:]
        for earlier in reversed(ahead):
            for ref in earlier.packed:
                packed = ref()
                if packed is not None and packed.back is None:
                    packed.back = self._bring_back(packed, ahead=True)
                    self.stats.prefetched += 1

    # ---- block hooks ------------------------------------------------------------------------------------------

    def _enter(self, module: nn.Module, args: Any) -> None:
        # This block and the in_flight - 1 before it may hold device tensors; older blocks' copies must be done.
        self._release_held(keep=self.in_flight - 1)
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._active.append(hooks)
        self._invocations.append(_Invocation())

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        # always_call: also runs when the forward raised, so the hook stack never leaks into later code.
        if not self._active:
            return
        self._active.pop().__exit__(None, None, None)
        invocation = self._invocations.pop()
        # Only weak references to the copies stay: autograd alone decides how long one (and its copy back) lives.
        invocation.seen.clear()
        if invocation.originals:
            self._held.append(invocation)
        self.stats.most_blocks_held = max(self.stats.most_blocks_held, len(self._held))
        if not invocation.packed:
            return
        grad_tensor = _first_grad_tensor(output)
        if grad_tensor is None:
            return
        # Forwards whose graphs were dropped without a backward leave only dead references: forget them.
        self._order = [entry for entry in self._order if any(ref() is not None for ref in entry.packed)]
        self._order.append(invocation)
        grad_tensor.register_hook(lambda grad, invocation=invocation: self._backward_begins(invocation))

    def install(self, block: nn.Module) -> None:
        """Offload what ``block`` saves during its forward (hooks run outside any compiled frame)."""
        block.register_forward_pre_hook(self._enter)
        block.register_forward_hook(self._exit, always_call=True)

    def metric_sources(self) -> dict[str, Callable[[], Any]]:
        """Per-step metrics (cumulative): tensors and MiB moved to host memory."""
        return {name: (lambda name=name: self.stats.as_metrics()[name]) for name in ("offload_tensors", "offload_mib")}


def apply_offload(
    model: nn.Module, *, enabled: bool, in_flight: int = 2, min_bytes: int = 1024
) -> ActivationOffloader | None:
    """Install offloading on every decoder block of ``model`` (after ``apply_ac``, so the hooks sit on the AC
    wrapper and see the inputs the checkpoint saves). Returns the offloader (``ParallelPlan.applied.offloader``);
    None when ``enabled`` is false. ``in_flight``: blocks whose offloaded tensors may be on the device at once."""
    if not enabled:
        return None
    offloader = ActivationOffloader(min_bytes=min_bytes, in_flight=in_flight)
    for block in decoder_layers(model):
        offloader.install(block)
    return offloader
