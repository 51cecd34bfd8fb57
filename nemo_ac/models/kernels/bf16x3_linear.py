"""An fp32 router's GEMM on bf16 tensor cores: ``model.moe.router_gemm: bf16x3`` (``nemo_ac::bf16x3_linear``).

Why. A router kept in fp32 (``model.moe.router_dtype: float32``, what transformers does for GLM-4.5 and Nemotron 3)
projects bf16 hidden states with an fp32 weight. As an fp32 GEMM it runs on CUDA cores, at 67 of an H100's 989 dense
TFLOP/s: at Automodel's Nemotron Super shape (64 H100s, 2 rows of 4096 tokens per micro batch, 512 experts) the
router's forward and backward took 0.33 s of a 6.67 s step by the dry run, for 1.3% of its FLOPs.

The method. The hidden states are bf16 already, so only the weight needs more than bf16's 8 bits: it is the exact
sum of three bf16 tensors (each the bf16 rounding of what the earlier ones left: 24 bits, fp32's mantissa), and a
bf16 x bf16 product is exact in fp32. So ``x @ W.T`` is three bf16 GEMMs with fp32 accumulation and output, done as
one GEMM against the three pieces stacked ([3E, H]) and summed smallest first: the fp32 GEMM's result up to the
order of the fp32 additions. The backward splits the fp32 gradient the same way: the weight's gradient is three
bf16 GEMMs against the (exact) bf16 input, again exact products; the input's gradient, rounded to bf16 in the end,
takes the three largest of the nine cross terms (``g1 w1 + g1 w2 + g2 w1``: 16 bits, twice bf16's). Every GEMM
writes fp32 (``torch.mm(..., out_dtype=torch.float32)`` on CUDA; elsewhere the same products as fp32 matmuls of
the bf16 values), so 3x the FLOPs run 15x faster.

As custom ops (``nemo_ac::bf16x3_linear`` and its backward): ``torch.compile`` calls them as single nodes, the
selective-AC policy treats the forward as a matmul, and FlopCounterMode / ``nemo-ac plan`` count their three GEMMs
by the formulas registered below, priced at the bf16 tensor peak (their lowest-precision input).
"""

from __future__ import annotations

import torch

from nemo_ac.models.kernels.op_flops import register_op_flops

PIECES = 3


def bf16_pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` (fp32) as ``PIECES`` bf16 tensors whose fp32 sum is ``t`` to fp32's 24 bits, largest first."""
    pieces = []
    rest = t.to(torch.float32)
    for _ in range(PIECES):
        piece = rest.to(torch.bfloat16)
        pieces.append(piece)
        rest = rest - piece.to(torch.float32)
    return pieces


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 operands, accumulated and returned in fp32 (on CUDA the tensor-core GEMM writing fp32;
    ``aten::mm.dtype`` has no CPU kernel, where fp32 matmuls of the same bf16 values compute the same products)."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.to(torch.float32) @ b.to(torch.float32)


def _sum_slices(stacked: torch.Tensor, width: int, *, dim: int) -> torch.Tensor:
    """The ``PIECES`` slices of ``stacked`` along ``dim`` added smallest (last) first."""
    slices = stacked.split(width, dim=dim)
    total = slices[-1]
    for piece in reversed(slices[:-1]):
        total = total + piece
    return total


@torch.library.custom_op("nemo_ac::bf16x3_linear", mutates_args=())
def bf16x3_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] bf16, weight [E, H] fp32 -> ``x @ weight.T`` [T, E] fp32 (module docstring)."""
    stacked = torch.cat(bf16_pieces(weight), dim=0)  # [3E, H]
    return _sum_slices(mm_fp32_out(x, stacked.t()), weight.shape[0], dim=1)


@bf16x3_linear.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("nemo_ac::bf16x3_linear_backward", mutates_args=())
def bf16x3_linear_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, input_grad: bool, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad [T, E] fp32 -> (grad_x [T, H] in x's dtype, grad_weight [E, H] fp32); a gradient not asked for is an
    empty tensor."""
    g = bf16_pieces(grad)
    grad_x = x.new_empty(0)
    grad_w = weight.new_empty(0)
    if input_grad:
        w = bf16_pieces(weight)
        # g1 w1 + g1 w2 + g2 w1: one GEMM over a 3E-wide contraction.
        grad_x = mm_fp32_out(torch.cat([g[0], g[0], g[1]], dim=1), torch.cat([w[0], w[1], w[0]], dim=0)).to(x.dtype)
    if weight_grad:
        grad_w = _sum_slices(mm_fp32_out(torch.cat(g, dim=1).t(), x), weight.shape[0], dim=0).to(weight.dtype)
    return grad_x, grad_w


@bf16x3_linear_backward.register_fake
def _(grad, x, weight, input_grad, weight_grad):
    return (
        x.new_empty(x.shape if input_grad else (0,)),
        weight.new_empty(weight.shape if weight_grad else (0,)),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, weight = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = torch.ops.nemo_ac.bf16x3_linear_backward(
        grad.contiguous(), x, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    )
    return (grad_x if ctx.needs_input_grad[0] else None), (grad_w if ctx.needs_input_grad[1] else None)


bf16x3_linear.register_autograd(_backward, setup_context=_setup_context)


def _forward_flops(x_shape, weight_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * weight_shape[0] * PIECES


def _backward_flops(grad_shape, x_shape, weight_shape, input_grad, weight_grad, *args, **kwargs) -> int:
    per_gemm = 2 * x_shape[0] * x_shape[1] * weight_shape[0] * PIECES
    return per_gemm * (int(bool(input_grad)) + int(bool(weight_grad)))


register_op_flops(torch.ops.nemo_ac.bf16x3_linear, _forward_flops)
register_op_flops(torch.ops.nemo_ac.bf16x3_linear_backward, _backward_flops)
