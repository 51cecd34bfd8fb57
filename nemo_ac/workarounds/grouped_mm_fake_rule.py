"""``aten._grouped_mm`` under ``torch.compile`` in fp32 / fp16: torch's fake rule accepts bf16 only.

Error prevented (torch 2.12, 2.13 and 2.14, compiling a block whose experts use ``grouped_mm`` in fp32: every tiny
recipe on CPU)::

    torch._dynamo.exc.TorchRuntimeError: ... RuntimeError when making fake tensor call
    RuntimeError: Expected inputs of BF16 type but got mat_a.dtype=torch.float32 and mat_b.dtype=torch.float32.

(torch 2.14 words it ``Expected mat_a to be BFloat16 or supported Float16 matrix, got torch.float32.``) torch 2.15.0's
fake rule accepts fp32 and fp16 on CPU: there the probe below says so and the custom op is not used.

Why: ``torch/_meta_registrations.py::_meta_grouped_mm_common`` (torch 2.13.0) was written for the CUDA bf16 kernel,
while the eager CPU kernels take fp32, bf16 and fp16.

Fix: a ``torch.library`` custom op ``nemo_ac::grouped_mm`` with a fake rule for any dtype and its own backward
(``nemo_ac::grouped_mm_backward``: two grouped GEMMs, no recompute of the forward); ``traceable_grouped_mm`` uses it
only for dtypes whose aten fake rule fails (bf16 keeps the aten op and inductor's lowering of it). Not version gated:
which dtypes need it is asked of torch's fake rule itself, once per dtype at import (``aten_grouped_mm_traceable``),
so the op steps aside by itself on a torch whose rule accepts the dtype. The selective-AC policy counts
``nemo_ac::grouped_mm`` as a matmul.

Upstream: none filed yet. Delete when: ``aten_grouped_mm_traceable(torch.float32)`` is True on every supported
torch (``tests/unit/models/kernels/test_experts_impl.py`` shows the raw failure and skips once torch fixes it).
"""

from __future__ import annotations

import logging

import torch

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def aten_fake_rule_error(dtype: torch.dtype) -> str | None:
    """What ``aten._grouped_mm``'s fake rule raises for ``dtype`` at a small experts shape (None: it accepts it).
    Runs the rule now, outside tracing: at import for ``aten_grouped_mm_traceable``, and in ``nemo-ac doctor``."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # the probe's expected failure is not an error worth a traceback
    try:
        with FakeTensorMode():
            x, w = torch.empty(8, 16, dtype=dtype), torch.empty(2, 16, 8, dtype=dtype)
            torch._grouped_mm(x, w, offs=torch.tensor([4, 8], dtype=torch.int32))
        return None
    except RuntimeError as exc:
        return str(exc)
    finally:
        fake_log.setLevel(level)


_ATEN_TRACEABLE = {dtype: aten_fake_rule_error(dtype) is None for dtype in GROUPED_MM_DTYPES}


def custom_op_needed() -> bool:
    """Whether some ``GROUPED_MM_DTYPES`` dtype needs the custom op on this torch (the registry's ``active``)."""
    return not all(aten_grouped_mm_traceable(dtype) for dtype in GROUPED_MM_DTYPES)


def aten_grouped_mm_traceable(dtype: torch.dtype) -> bool:
    """Whether ``torch.compile`` can trace ``aten._grouped_mm`` in ``dtype`` (torch 2.13: bf16 only)."""
    return _ATEN_TRACEABLE.get(dtype, False)


@torch.library.custom_op("nemo_ac::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [E, K, N]`` per row group (``offs`` cumulative row ends) -> [M, N]."""
    return torch._grouped_mm(x, w, offs=offs)


@_grouped_mm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("nemo_ac::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward_op(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [M, K] = grad @ w[e]^T per group; dw [E, K, N] = x[rows_e]^T @ grad[rows_e] (an empty group: zeros).

    ``dw`` comes out with ``w``'s strides: the weight is stored [E, N, K] and passed transposed, so its gradient
    is computed as [E, N, K] (grad^T @ x) and handed back transposed; the parameter's gradient is then contiguous
    and accumulates without a strided copy."""
    grad = grad.contiguous()
    grad_x = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs)
    if w.transpose(-2, -1).is_contiguous():
        grad_w = torch._grouped_mm(grad.transpose(0, 1), x, offs=offs).transpose(-2, -1)
    else:
        grad_w = torch._grouped_mm(x.transpose(0, 1), grad, offs=offs)
    return grad_x, grad_w


@_grouped_mm_backward_op.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), torch.empty_like(w)  # the strides the real kernel returns (see its docstring)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    x, w, offs = ctx.saved_tensors
    grad_x, grad_w = _grouped_mm_backward_op(grad, x, w, offs)
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def traceable_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` that autograd and ``torch.compile`` accept in every
    ``GROUPED_MM_DTYPES`` dtype: the aten op where its fake rule takes the dtype, the custom op elsewhere."""
    if aten_grouped_mm_traceable(x.dtype):
        return torch._grouped_mm(x, w, offs=offs)
    return _grouped_mm_op(x, w, offs)
