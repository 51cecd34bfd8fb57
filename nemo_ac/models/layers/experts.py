"""Routed experts stored as 3D weights (transformers 5 ``Qwen3MoeExperts`` layout).

``gate_up_proj`` is [E, 2*I, H] (gate rows first, then up rows) for SwiGLU, or [E, I, H] for ``relu2``
(``relu(x)^2``, no gate, Nemotron-H); ``down_proj`` is [E, H, I]. The first weight's attribute name is
``in_proj_name`` (default ``gate_up_proj``; Nemotron-H's transformers name is ``up_proj``) so state-dict keys equal
the reference family's; code outside should use the ``in_proj`` property rather than either name. The forward
takes rows already permuted into expert-contiguous order and the per-expert counts, so it is agnostic to how tokens
got there (local sort or expert-parallel all-to-all). ``E`` here is the number of *local* experts (dim 0 of the
weights).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_ac.models.kernels.grouped_gemm import GROUPED_MM_DTYPES, grouped_matmul, widths_aligned

ExpertsImpl = Literal["loop", "grouped_mm"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """Expert weights sharded over an EP mesh are DTensors; the math runs on this rank's experts only."""
    return t.to_local() if isinstance(t, DTensor) else t


def _per_expert_linear(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``cat_e(F.linear(x_e, w[e]))`` with the weight split by one ``unbind`` (never ``w[e]``)."""
    outs = [F.linear(rows, w_e) for rows, w_e in zip(x.split(counts), w.unbind(0), strict=True)]
    return torch.cat(outs) if outs else x.new_empty(0, w.shape[1])


class _ExpertLinears(torch.autograd.Function):
    """``cat_e(x_e @ w[e]^T)`` over expert-contiguous row groups (``x_e = x.split(counts)[e]``) whose backward writes
    each expert's weight gradient once, straight into one [E, N, K] buffer (``torch.mm(..., out=grad_w[e])``).

    Autograd through ``weight[e]`` writes a zero tensor the size of the whole weight per expert (SelectBackward)
    and through ``weight.unbind(0)`` copies all slice gradients once more (a ``cat``: 44-57% of the loop's step at
    64 GLM-width experts); this writes the gradient once, as grouped_mm does. Eager only: compiled graphs take the
    ``unbind`` form, which inductor schedules itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ctx.counts = counts
        ctx.save_for_backward(x, w)
        return _per_expert_linear(x, w, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        grads = grad.split(ctx.counts)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat([g @ w_e for g, w_e in zip(grads, w.unbind(0), strict=True)])
        if ctx.needs_input_grad[1]:
            grad_w = torch.empty_like(w, memory_format=torch.contiguous_format)
            for e, (g, rows) in enumerate(zip(grads, x.split(ctx.counts), strict=True)):
                torch.mm(g.t(), rows, out=grad_w[e])  # an expert with no rows: zeros
        return grad_x, grad_w, None


def expert_linears(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Per-expert ``F.linear`` over row groups; see ``_ExpertLinears`` (eager) and its ``unbind`` form (compiled)."""
    if torch.compiler.is_compiling():
        return _per_expert_linear(x, w, counts)
    return _ExpertLinears.apply(x, w, counts)


def grouped_mm_supported(*, device_type: str, dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> bool:
    """Whether ``impl="grouped_mm"`` runs forward and backward for these experts: a device with the kernel
    (CPU, CUDA), a dtype it takes (fp32 / bf16 / fp16; not fp64) and 16-byte aligned widths (see
    ``nemo_ac.models.kernels.grouped_gemm``)."""
    return (
        hasattr(torch, "_grouped_mm")
        and device_type in ("cpu", "cuda")
        and dtype in GROUPED_MM_DTYPES
        and widths_aligned(dtype, hidden_size, intermediate_size)
    )


class GroupedExperts(nn.Module):
    """Per-expert feed-forward over expert-contiguous rows.

    ``impl``: ``"grouped_mm"`` (``torch._grouped_mm`` with cumulative offsets on the device, no host sync; what
    recipes get where it is supported, ``distributed.plan.kernels``) or ``"loop"`` (the reference and fallback: one
    matmul pair per local expert via ``torch.split`` of the counts, which syncs on ``tokens_per_expert.tolist()``).
    ``"auto"`` picks per call by the rows' device and dtype with the same rule (for modules built outside a
    recipe, e.g. fp64 tests). An expert with zero rows yields an empty slice and a zero gradient.

    The loop never indexes ``weight[e]``: each indexing select's backward writes a zero tensor the size of the
    whole [E, 2I, H] weight and autograd sums E of them, so the old loop's backward cost grew with experts x weight
    size (x85 from 16 to 128 experts at the same tokens). ``expert_linears`` writes each expert's gradient once
    into one buffer (eager; compiled graphs split the weight with one ``unbind``).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: Literal["silu", "relu2"] = "silu",
        impl: Literal["auto", "loop", "grouped_mm"] = "loop",
        in_proj_name: Literal["gate_up_proj", "up_proj"] = "gate_up_proj",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.impl = impl
        if activation == "silu" and in_proj_name != "gate_up_proj":
            raise ValueError("gated (silu) experts keep gate and up rows in one 'gate_up_proj' weight")
        self.in_proj_name = in_proj_name
        up_rows = 2 * intermediate_size if activation == "silu" else intermediate_size
        self.register_parameter(in_proj_name, nn.Parameter(torch.empty(num_experts, up_rows, hidden_size)))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @property
    def in_proj(self) -> torch.Tensor:
        """The [E, 2I or I, H] input projection, whatever its attribute name (FSDP2 swaps it by that name)."""
        return getattr(self, self.in_proj_name)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.relu(h).square()

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: [N, H] expert-contiguous rows; tokens_per_expert: [E_local] int counts summing to N. Returns [N, H]."""
        gate_up, down = _local(self.in_proj), _local(self.down_proj)
        if gate_up.shape[0] != tokens_per_expert.shape[0]:
            raise ValueError(
                f"tokens_per_expert has {tokens_per_expert.shape[0]} entries but there are {gate_up.shape[0]} "
                "local experts"
            )
        impl = self.impl
        if impl == "auto":  # a module built outside a recipe: the rule of distributed.plan.kernels, per call
            supported = grouped_mm_supported(
                device_type=x.device.type,
                dtype=x.dtype,
                hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size,
            )
            impl = "grouped_mm" if supported else "loop"
        if impl == "grouped_mm":
            return self._forward_grouped_mm(x, tokens_per_expert, gate_up, down)
        return self._forward_loop(x, tokens_per_expert, gate_up, down)

    def _forward_loop(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        counts = tokens_per_expert.tolist()
        return expert_linears(self._act(expert_linears(x, gate_up, counts)), down, counts)

    def _forward_grouped_mm(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        offs = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)
        h = grouped_matmul(x, gate_up.transpose(-2, -1), offs)
        return grouped_matmul(self._act(h), down.transpose(-2, -1), offs)
