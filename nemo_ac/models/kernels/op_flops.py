"""FLOP formulas for nemo_ac's custom ops, so torch's ``FlopCounterMode`` (and the profiler's FLOP column, MFU
scripts, ``nemo-ac plan``) count their work instead of 0.

``FlopCounterMode`` counts only ops with a formula in ``torch.utils.flop_counter.flop_registry``; every other op,
``torch.library`` custom ops included, counts 0 without a word: the tiny Qwen3 MoE layer's forward read 4.82 MFLOP
without the grouped GEMMs, 9.54 MFLOP with them. Each op module registers its formula next to its definition with
``register_op_flops`` (public ``torch.utils.flop_counter.register_flop_formula``), once per process.

Conventions (those of torch's own formulas): a multiply-add is 2 FLOPs; only matmul-like work counts (softmax,
exponentials and elementwise ops are 0 in torch's formulas as well); a backward formula counts what the backward op
computes. Ops that move data and compute nothing (DeepEP's dispatch / combine, the routing choice) register 0, so a
FLOP report can tell "no work" from "no formula" (``ops_without_formula``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula

# Namespaces whose ops never compute (views, collectives, profiler markers, FSDP's copy-in/out, DTensor plumbing).
_NON_COMPUTE_NAMESPACES = frozenset(
    {
        "c10d",
        "_c10d_functional",
        "_c10d_functional_autograd",
        "profiler",
        "fsdp",
        "_dtensor",
        "prims",
        "prim",
        "inductor",
    }
)
# aten ops that do matmul-like work: one of these without a formula would be an undercount (kept to the ones torch
# registers no formula for on some release; ``_grouped_mm`` is registered by nemo_ac where torch has none).
_ATEN_COMPUTE = frozenset(
    {
        "_grouped_mm",
        "_scaled_grouped_mm",
        "einsum",
        "linear",
        "matmul",
        "tensordot",
        "linalg_solve_triangular",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    }
)
# aten ops that compute what a CUDA twin computes, which torch has a formula for and they have not: the twin's formula
# is registered for them. SDPA's fused CPU kernel is what ``backend.attention: sdpa`` runs on CPU, so what the dry run
# counts for a CUDA plan (the fake step runs on CPU): without it, on one H200, the dry run of a compiled SDPA step
# counted 23.9 TFLOP against FlopCounterMode's 31.6 on the GPU (attention's 7.7, forward and backward, counted 0).
_CUDA_TWINS = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
}


def register_op_flops(packet: Any, formula: Callable[..., int], *, get_raw: bool = False) -> bool:
    """Register ``formula`` for the op overload packet ``packet`` unless one is registered already (a later torch
    may bring its own: torch's wins). Returns whether this call registered it."""
    if packet in flop_registry:
        return False
    register_flop_formula(packet, get_raw=get_raw)(formula)
    return True


def zero_flops(*args: Any, **kwargs: Any) -> int:
    """For ops that move or select data and compute nothing a FLOP count measures."""
    return 0


def has_formula(func: Any) -> bool:
    """Whether ``FlopCounterMode`` counts ``func`` (an OpOverload or packet)."""
    packet = getattr(func, "overloadpacket", func)
    return packet in flop_registry


def needs_formula(func: Any) -> bool:
    """Whether ``func`` may do work that a FLOP count would miss: any op outside aten / the non-compute namespaces
    (custom ops), and aten's matmul-like ops, when no formula is registered."""
    if has_formula(func):
        return False
    namespace = getattr(func, "namespace", "")
    name = getattr(getattr(func, "overloadpacket", func), "__name__", "")
    if namespace == "aten":
        return name in _ATEN_COMPUTE
    return namespace not in _NON_COMPUTE_NAMESPACES


def ops_without_formula(funcs: Iterable[Any]) -> list[str]:
    """Names of the ops in ``funcs`` whose FLOPs ``FlopCounterMode`` would count as 0 although they may compute."""
    return sorted({str(getattr(f, "overloadpacket", f)) for f in funcs if needs_formula(f)})


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """``_grouped_mm(a, b, offs)``: 2D x 3D (rows of ``a`` grouped: [M, K] x [E, K, N] -> [M, N]), 2D x 2D (the
    contraction grouped: [M, K] x [K, N] -> [E, M, N]), 3D x 2D and 3D x 3D (batched). Every group's rows are
    counted once: 2 * M * K * N over the whole op, whatever the offsets."""
    a, b = list(a_shape), list(b_shape)
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


def grouped_mm_backward_flops(grad_shape: Any, x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    """``nemo_ac::grouped_mm_backward``: dx = grad @ w^T and dw = x^T @ grad per group, each as many FLOPs as the
    forward [M, K] x [E, K, N]."""
    m, k = list(x_shape)
    n = list(w_shape)[-1]
    return 2 * (2 * m * k * n)


def solve_triangular_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """``linalg_solve_triangular(A [..., n, n], B [..., n, k])``: n^2 k multiply-adds... halved by the triangle,
    so n^2 k FLOPs per system (torch registers no formula: Gated DeltaNet's chunk solve counted 0)."""
    n, k = list(b_shape)[-2], list(b_shape)[-1]
    batch = 1
    for size in list(out_shape or b_shape)[:-2]:
        batch *= size
    return batch * n * n * k


_REFERENCE_CACHE: dict[tuple, int] = {}


def reference_flops(key: tuple, run: Callable[[], torch.Tensor], *, backward: bool) -> int:
    """What ``FlopCounterMode`` counts for ``run()`` (forward, and its backward when ``backward``): the FLOPs of a
    GPU kernel's custom op taken from nemo_ac's torch reference of the same algorithm at the same shapes. ``run``
    builds its inputs (``torch.empty`` of the op's shapes, ``requires_grad`` for backward) and runs the reference;
    it runs once per ``key``, on fake tensors, outside every active dispatch mode (``fake_world.isolated_fake_mode``)."""
    if key not in _REFERENCE_CACHE:
        from torch.utils.flop_counter import FlopCounterMode

        from nemo_ac.workarounds.autograd_inside_op import autograd_inside_op
        from nemo_ac.workarounds.fake_world import isolated_fake_mode

        # Autograd on: a backward formula is asked from inside autograd's backward and a custom op's dispatch, where
        # grad mode is off and the autograd keys are excluded (workarounds.autograd_inside_op).
        with isolated_fake_mode(), autograd_inside_op(), FlopCounterMode(display=False) as counter:
            out = run()
            if backward:
                out.float().sum().backward()
        _REFERENCE_CACHE[key] = int(counter.get_total_flops())
    return _REFERENCE_CACHE[key]


def _register_aten() -> None:
    if hasattr(torch.ops.aten, "_grouped_mm"):
        register_op_flops(torch.ops.aten._grouped_mm, grouped_mm_flops)
    register_op_flops(torch.ops.aten.linalg_solve_triangular, solve_triangular_flops)
    for name, twin in _CUDA_TWINS.items():
        op, twin_op = getattr(torch.ops.aten, name, None), getattr(torch.ops.aten, twin, None)
        if op is not None and twin_op in flop_registry:  # torch's own formula, as it is registered (raw)
            register_op_flops(op, flop_registry[twin_op], get_raw=True)


_register_aten()
