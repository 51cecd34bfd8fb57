"""Measuring one forward + backward honestly: counted FLOPs, tracked peak memory, median time, matmul peak.

- FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` with formulas for what torch 2.13 leaves uncounted on CPU
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, ``aten._grouped_mm``, nemo_ac's
  ``nemo_ac::grouped_mm`` / ``grouped_mm_backward``). ``model`` counting scores only the visible (causal,
  same-document) attention pairs; ``executed`` counting scores what the kernel computes (every pair under a dense
  mask, half under ``is_causal``).
- Memory on CPU: the peak of bytes allocated through torch's CPU allocator during the step and not yet freed, from
  the profiler's allocation events (``profile_memory=True``): activations, gradients, temporaries and kernel
  workspaces; weights, inputs and what existed before the step are not counted. On CUDA:
  ``torch.cuda.max_memory_allocated`` above the step's start. Held memory (``held_bytes``): what a forward leaves
  allocated for its backward, from the same events (CUDA: ``torch.cuda.memory_allocated``).
- Peak: ``F.linear`` (the layers' own GEMM form, ``x @ W^T``) throughput at a given shape and dtype, measured in
  the same process.
- Allocator: on Linux/glibc the benchmark keeps freed memory in the process (``keep_freed_memory``). Without it each
  large tensor is a fresh ``mmap`` whose pages fault in on first touch, and glibc's adaptive mmap threshold makes
  whichever stack runs first in a process pay more of them (seen here: the same sub-block 3x slower as the first
  stack than as the third, with more system than user time).
"""

from __future__ import annotations

import contextlib
import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters


_M_MMAP_THRESHOLD = -3


def fixed_mmap_threshold(nbytes: int = 32 << 20) -> bool:
    """glibc: a fixed mmap threshold (no adaptive one): every allocation above ``nbytes`` is a fresh ``mmap`` for
    every stack alike. For runs whose single stacks are large (``moe_experts.py``), where keeping every freed page
    (``keep_freed_memory``) fragments the heap past this machine's memory."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes))
    except OSError:
        return False


def release_free_memory() -> None:
    """glibc: hand the heap's free pages back (between rows, so memory stays bounded over a long run)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def keep_freed_memory() -> bool:
    """glibc: never ``mmap`` an allocation and never give freed memory back, so every stack of every row reuses the
    same warm pages (see the module docstring). Returns False where this is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def _grouped_mm_flop(a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    """[M, K] x [E, K, N] (rows split over E groups) or [K, M] x [M, N] -> [E, K, N] (offsets split M)."""
    if len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _grouped_mm_backward_flop(grad_shape: Any, x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * _grouped_mm_flop(x_shape, w_shape)


def _sdpa_formulas(*, visible_fraction: float | None) -> dict[Any, Callable[..., int]]:
    """CPU flash attention: scaled by ``visible_fraction`` (model FLOPs) or by what the kernel runs (executed)."""

    def scale(is_causal: bool) -> float:
        if visible_fraction is not None:
            return visible_fraction
        return 0.5 if is_causal else 1.0

    def forward(q: Any, k: Any, v: Any, dropout: float = 0.0, is_causal: bool = False, *a: Any, **kw: Any) -> int:
        return int(sdpa_flop_count(q, k, v) * scale(is_causal))

    def backward(
        grad: Any,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        dropout: float = 0.0,
        is_causal: bool = False,
        *a: Any,
        **kw: Any,
    ) -> int:
        return int(sdpa_backward_flop_count(grad, q, k, v) * scale(is_causal))

    return {
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }


def _packed_attention_formulas(*, visible_fraction: float | None) -> dict[Any, Callable[..., int]]:
    """The tiled op (opaque to FlopCounterMode): 4 * d FLOPs per computed (query, key) pair and head forward, 10 * d
    backward. Shapes alone cannot tell which tiles it computed; this assumes one causal document per row (the
    flagship rows' layout, where it computes the visible half to within a tile: ratio 1.01 in
    benchmarks/results/packed_attention.md, whose own counts run the op's plain-torch code instead)."""
    fraction = 0.5 if visible_fraction is None else visible_fraction

    def pairs(q_shape: Any, k_shape: Any) -> float:
        b, sq, h, d = q_shape
        return b * h * sq * k_shape[1] * d * fraction

    def forward(q: Any, k: Any, *args: Any, **kwargs: Any) -> int:
        return int(4 * pairs(q, k))

    def backward(grad: Any, grad_lse: Any, q: Any, k: Any, *args: Any, **kwargs: Any) -> int:
        return int(10 * pairs(q, k))

    return {torch.ops.nemo_ac.packed_attention: forward, torch.ops.nemo_ac.packed_attention_backward: backward}


_CUDA_SDPA = (
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
)


def _scaled(formula: Callable[..., int], fraction: float) -> Callable[..., int]:
    return lambda *args, **kwargs: int(formula(*args, **kwargs) * fraction)


def _grouped_query(formula: Callable[..., int], *, query_at: int) -> Callable[..., int]:
    """torch's CUDA SDPA formula for grouped-query calls (``enable_gqa``: fewer key / value heads, as transformers
    calls SDPA on CUDA), which its ``sdpa_flop_count`` refuses (``query/key/value shapes are incompatible``, seen on
    an H200): key and value counted with the query's heads, as the kernel computes them. ``query_at``: the query's
    position (0 forward, 1 backward, after the output gradient)."""

    def count(*args: Any, **kwargs: Any) -> int:
        query, key, value = args[query_at : query_at + 3]
        if key.shape[1] != query.shape[1]:
            key = torch.empty(*key.shape[:1], query.shape[1], *key.shape[2:], device="meta")
            value = torch.empty(*value.shape[:1], query.shape[1], *value.shape[2:], device="meta")
            args = (*args[:query_at], query, key, value, *args[query_at + 3 :])
        return formula(*args, **kwargs)

    return count


def flop_mapping(*, visible_fraction: float | None) -> dict[Any, Callable[..., int]]:
    mapping: dict[Any, Callable[..., int]] = {aten._grouped_mm: _grouped_mm_flop}
    for op in _CUDA_SDPA:  # CUDA kernels: torch's own formulas (dense), scaled to the visible pairs where asked
        if op in flop_registry:
            formula = _grouped_query(flop_registry[op], query_at=1 if op.__name__.endswith("_backward") else 0)
            mapping[op] = formula if visible_fraction is None else _scaled(formula, visible_fraction)
    if hasattr(torch.ops, "nemo_ac") and hasattr(torch.ops.nemo_ac, "grouped_mm"):
        mapping[torch.ops.nemo_ac.grouped_mm] = _grouped_mm_flop
        mapping[torch.ops.nemo_ac.grouped_mm_backward] = _grouped_mm_backward_flop
    if hasattr(torch.ops, "nemo_ac") and hasattr(torch.ops.nemo_ac, "packed_attention"):
        mapping.update(_packed_attention_formulas(visible_fraction=visible_fraction))
    mapping.update(_sdpa_formulas(visible_fraction=visible_fraction))
    return mapping


def count_flops(step: Callable[[], None], *, visible_fraction: float | None) -> int:
    """FLOPs of one ``step()`` (forward + backward)."""
    counter = FlopCounterMode(display=False, custom_mapping=flop_mapping(visible_fraction=visible_fraction))
    with counter:
        step()
    return counter.get_total_flops()


def peak_bytes(step: Callable[[], None], *, device: torch.device) -> int:
    """Peak bytes allocated by one ``step()`` above what existed before it (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:  # allocations positive, frees negative, in time order
        live += nbytes
        peak = max(peak, live)
    return peak


def held_bytes(forward: Callable[[], torch.Tensor], *, device: torch.device) -> int:
    """Bytes a ``forward()`` leaves allocated for its backward: allocated during the forward, still alive when it
    returns, less its output. What autograd (or activation checkpointing: its saved inputs and the tensors a
    selective policy kept) holds between forward and backward, not a peak inside either. The graph is released
    without a backward."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        out = forward()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            out = forward()
        held = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    held -= out.untyped_storage().nbytes()
    del out
    return held


def time_steps(step: Callable[[], None], *, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` steps after ``warmup`` untimed ones."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    return times


_PEAKS: dict[tuple[int, int, int, torch.dtype, str], float] = {}


def matmul_peak(m: int, k: int, n: int, *, dtype: torch.dtype, device: torch.device) -> float:
    """Median FLOP/s of ``F.linear([m, k], [n, k])`` here (cached per shape): the machine's own matmul speed."""
    key = (m, k, n, dtype, str(device))
    if key not in _PEAKS:
        a = torch.randn(m, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device)
        reps = max(5, min(20, int(2e10 / max(1, 2 * m * k * n))))
        times = time_steps(lambda: torch.nn.functional.linear(a, w), device=device, warmup=2, repeats=reps)
        _PEAKS[key] = 2 * m * k * n / statistics.median(times)
    return _PEAKS[key]
