"""One GEMM per expert over expert-contiguous rows, without a host sync, that also compiles in fp32.

``torch._grouped_mm(x [M, K], w [E, K, N], offs=[E] int32 cumulative row ends)`` runs every expert's
``x[rows_e] @ w[e]`` in one call with the offsets on the device (no ``.tolist()``). Its eager kernels take fp32,
bf16 and fp16 on CPU, but torch's fake-tensor (meta) rule, which ``torch.compile`` uses to trace it, accepts bf16
only::

    torch._dynamo.exc.TorchRuntimeError: ... RuntimeError when making fake tensor call
    RuntimeError: Expected inputs of BF16 type but got mat_a.dtype=torch.float32 and mat_b.dtype=torch.float32.

(``torch/_meta_registrations.py::_meta_grouped_mm_common``, torch 2.13.0, written for the CUDA kernel.) So a
compiled fp32 MoE block (every tiny recipe on CPU) could not use the grouped path at all.

``grouped_matmul`` calls the aten op directly where its fake rule accepts the dtype (bf16: inductor keeps its own
lowering of ``aten._grouped_mm``), and otherwise a ``torch.library`` custom op ``nemo_ac::grouped_mm`` with a fake
rule for any dtype and its own backward (``nemo_ac::grouped_mm_backward``, two grouped GEMMs, no recompute of the
forward). Which one is decided once per dtype by asking the fake rule itself (``aten_grouped_mm_traceable``), so
the custom op steps aside by itself on a torch whose rule accepts the dtype; delete it then. The selective-AC
policy counts ``nemo_ac::grouped_mm`` as a matmul (``nemo_ac.distributed.activation_checkpointing``).

Alignment: every kernel needs 16-byte aligned row strides (``widths_aligned``): hidden and expert widths multiples
of 4 (fp32) or 8 (bf16/fp16) elements. The backward makes the incoming gradient contiguous: the CPU kernel rejects
the stride-0 gradient that ``out.sum().backward()`` produces ("Invalid strides/sizes, got [0, 0]").
"""

from __future__ import annotations

import logging

import torch

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def widths_aligned(dtype: torch.dtype, *widths: int) -> bool:
    """True when rows of every width are 16-byte aligned in ``dtype`` (what ``_grouped_mm`` requires)."""
    elements = 16 // torch.empty((), dtype=dtype).element_size()
    return all(w % elements == 0 for w in widths)


def _probe_aten_fake_rule(dtype: torch.dtype) -> bool:
    """Whether ``aten._grouped_mm``'s fake rule accepts ``dtype`` (run once per dtype at import, outside tracing)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # the probe's expected failure is not an error worth a traceback
    try:
        with FakeTensorMode():
            x, w = torch.empty(8, 16, dtype=dtype), torch.empty(2, 16, 8, dtype=dtype)
            torch._grouped_mm(x, w, offs=torch.tensor([4, 8], dtype=torch.int32))
        return True
    except RuntimeError:
        return False
    finally:
        fake_log.setLevel(level)


_ATEN_TRACEABLE = {dtype: _probe_aten_fake_rule(dtype) for dtype in GROUPED_MM_DTYPES}


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


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` that autograd and ``torch.compile`` accept in every
    ``GROUPED_MM_DTYPES`` dtype (see the module docstring)."""
    if aten_grouped_mm_traceable(x.dtype):
        return torch._grouped_mm(x, w, offs=offs)
    return _grouped_mm_op(x, w, offs)
