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
stream), records an event and calls ``record_stream`` so the device memory is only reused once the copy is done;
``unpack`` makes the current stream wait for that event and copies back asynchronously. On CPU the compute device
*is* host memory, so ``pack`` copies into a separate host buffer and drops the reference to the original; the
counters (tensors and bytes packed / unpacked) make the work observable, and tests check values and losses
against a run without offloading. Parameters (and views of them, such as a transposed weight saved by ``mm``) are
never copied: they stay alive anyway (FSDP2 re-gathers them for backward), so moving them would cost bandwidth and
free nothing. A tensor saved several times in one block (``x`` feeding q, k and v projections) is copied once.
Tensors smaller than ``min_bytes`` stay where they are. Copies keep the saved tensor's strides (views with gaps
included) and its address modulo 256 bytes: GEMMs choose kernels by leading dimension and alignment, and a
contiguous or differently aligned copy changed the last bits of gradients (measured on CPU with MKL); with both
kept, offloading is bitwise invisible to the result.

Validation rejects ``offload`` with ``compile.enabled`` (not verified: compiled blocks save inside their compiled
autograd function) and with ``mode: selective`` (above). Vision-tower blocks are not offloaded.

Not done: prefetching the next block's tensors during backward (each block's tensors are copied back when autograd
first needs them, on the compute stream, from pinned memory).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
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
    unpacked: int = 0  # copies brought back for backward
    deduplicated: int = 0  # saves of a tensor already copied in the same block invocation
    kept: int = 0  # saves left in place (parameters, tiny tensors)

    def as_metrics(self) -> dict[str, float]:
        return {"offload_tensors": self.packed, "offload_mib": round(self.packed_bytes / 2**20, 3)}


@dataclass
class _Packed:
    """A host copy and how to bring it back (autograd restores requires_grad / grad_fn itself on unpack)."""

    host: torch.Tensor
    device: torch.device
    address_mod: int  # the original's address modulo _ALIGN_BYTES, reproduced by the copy back
    event: Any = None  # torch.cuda.Event on CUDA


@dataclass
class _Kept:
    tensor: torch.Tensor


@dataclass
class _Invocation:
    """Per block forward: tensors already copied (weak reference check against id reuse)."""

    seen: dict[int, tuple[weakref.ref, _Packed]] = field(default_factory=dict)


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter)


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

    def __init__(self, *, min_bytes: int = 1024) -> None:
        self.min_bytes = min_bytes
        # Where a copy goes when it only has to leave the device's memory accounting: the dry run
        # (nemo_ac.simulate) sets "meta" (fake tensors have no address to align); None: host memory as above.
        self.accounting_host: str | None = None
        self.stats = OffloadStats()
        self._stream: Any = None
        # One entry per block forward in progress (blocks do not nest; a stack keeps enter/exit paired).
        self._invocations: list[_Invocation] = []
        self._active: list[torch.autograd.graph.saved_tensors_hooks] = []

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
        packed = self._copy_to_host(tensor)
        self.stats.packed += 1
        self.stats.packed_bytes += nbytes
        if invocation is not None:
            invocation.seen[id(tensor)] = (weakref.ref(tensor), packed)
        return packed

    def unpack(self, packed: _Packed | _Kept) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        self.stats.unpacked += 1
        if self.accounting_host is not None:
            return packed.host.to(packed.device)
        if packed.device.type == "cuda":
            torch.cuda.current_stream(packed.device).wait_event(packed.event)
            device_copy = _empty_like_aligned(packed.host, device=packed.device, address_mod=packed.address_mod)
            return device_copy.copy_(packed.host, non_blocking=True)
        return packed.host  # CPU: the host buffer is what backward reads

    def _copy_to_host(self, tensor: torch.Tensor) -> _Packed:
        if self.accounting_host is not None:
            return _Packed(host=tensor.detach().to(self.accounting_host), device=tensor.device, address_mod=0)
        address_mod = tensor.data_ptr() % _ALIGN_BYTES
        if tensor.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(tensor.device)
            host = _empty_like_aligned(tensor, device="cpu", address_mod=address_mod, pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                host.copy_(tensor, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            # The caching allocator must not hand this memory out before the copy on the side stream has read it.
            tensor.record_stream(self._stream)
            return _Packed(host=host, device=tensor.device, address_mod=address_mod, event=event)
        host = _empty_like_aligned(tensor, device="cpu", address_mod=address_mod)
        host.copy_(tensor.detach())
        return _Packed(host=host, device=tensor.device, address_mod=address_mod)

    # ---- block hooks ------------------------------------------------------------------------------------------

    def _enter(self, module: nn.Module, args: Any) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._active.append(hooks)
        self._invocations.append(_Invocation())

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        # always_call: also runs when the forward raised, so the hook stack never leaks into later code.
        if self._active:
            self._active.pop().__exit__(None, None, None)
            self._invocations.pop()

    def install(self, block: nn.Module) -> None:
        """Offload what ``block`` saves during its forward (hooks run outside any compiled frame)."""
        block.register_forward_pre_hook(self._enter)
        block.register_forward_hook(self._exit, always_call=True)

    def metric_sources(self) -> dict[str, Callable[[], Any]]:
        """Per-step metrics (cumulative): tensors and MiB moved to host memory."""
        return {name: (lambda name=name: self.stats.as_metrics()[name]) for name in ("offload_tensors", "offload_mib")}


def apply_offload(model: nn.Module, *, enabled: bool, min_bytes: int = 1024) -> ActivationOffloader | None:
    """Install offloading on every decoder block of ``model`` (after ``apply_ac``, so the hooks sit on the AC
    wrapper and see the inputs the checkpoint saves). Returns the offloader (``ParallelPlan.applied.offloader``);
    None when ``enabled`` is false."""
    if not enabled:
        return None
    offloader = ActivationOffloader(min_bytes=min_bytes)
    for block in decoder_layers(model):
        offloader.install(block)
    return offloader
