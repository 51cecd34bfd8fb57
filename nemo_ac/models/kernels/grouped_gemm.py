"""One GEMM per expert over expert-contiguous rows, without a host sync, that also compiles in fp32.

``torch._grouped_mm(x [M, K], w [E, K, N], offs=[E] int32 cumulative row ends)`` runs every expert's
``x[rows_e] @ w[e]`` in one call with the offsets on the device (no ``.tolist()``). Its eager kernels take fp32,
bf16 and fp16 on CPU, but torch 2.13's fake rule (what ``torch.compile`` traces with) takes bf16 only: the custom
op that covers the other dtypes is a workaround, ``nemo_ac.workarounds.grouped_mm_fake_rule``.

Alignment: every kernel needs 16-byte aligned row strides (``widths_aligned``): hidden and expert widths multiples
of 4 (fp32) or 8 (bf16/fp16) elements. The backward makes the incoming gradient contiguous: the CPU kernel rejects
the stride-0 gradient that ``out.sum().backward()`` produces ("Invalid strides/sizes, got [0, 0]").
"""

from __future__ import annotations

import torch

from nemo_ac.models.kernels.op_flops import grouped_mm_backward_flops, grouped_mm_flops, register_op_flops
from nemo_ac.workarounds.grouped_mm_fake_rule import GROUPED_MM_DTYPES, traceable_grouped_mm

__all__ = ["GROUPED_MM_DTYPES", "grouped_matmul", "widths_aligned"]

# FlopCounterMode counts torch._grouped_mm (torch 2.13 has no formula) and the fp32 custom op pair (op_flops).
register_op_flops(torch.ops.nemo_ac.grouped_mm, grouped_mm_flops)
register_op_flops(torch.ops.nemo_ac.grouped_mm_backward, grouped_mm_backward_flops)


def widths_aligned(dtype: torch.dtype, *widths: int) -> bool:
    """True when rows of every width are 16-byte aligned in ``dtype`` (what ``_grouped_mm`` requires)."""
    elements = 16 // torch.empty((), dtype=dtype).element_size()
    return all(w % elements == 0 for w in widths)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` in any ``GROUPED_MM_DTYPES`` dtype, eager or compiled."""
    return traceable_grouped_mm(x, w, offs)
