"""``backend.dispatcher: deepep``: DeepEP's fused all-to-all kernels (CUDA, NVLink/RDMA), imported lazily.

Written against DeepEP's public ``deep_ep.Buffer`` API (``get_dispatch_layout`` / ``dispatch`` / ``combine`` with a
``handle``; ``combine`` of gradients is the backward of ``dispatch`` and vice versa). DeepEP sends each token once
per destination rank (not once per expert), with its top-k ids rewritten to local expert ids (-1: not here) and
its router weights; so the router weights are applied on the expert side, before the tokens go home, and their
gradient comes back through ``combine(..., topk_weights=)``. That is why ``MoE`` passes ``top_scores`` to
``dispatch``.

Not testable on CPU machines: CI only checks that asking for it without ``deep_ep`` or without CUDA fails with the
recipe key and the install line. Parity of this path against ``backend.dispatcher: torch`` needs a multi-GPU run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.models.common.dispatch import permute_tokens, sort_by_expert

_INSTALL_HINT = "pip install 'nemo_ac[deepep]' on a CUDA machine, or set backend.dispatcher: torch"


def import_deep_ep() -> Any:
    """The ``deep_ep`` module, or a ConfigError naming ``backend.dispatcher`` and the install extra."""
    try:
        import deep_ep
    except ImportError as exc:
        raise ConfigError(
            ConfigIssue("backend.dispatcher", f"'deepep' needs the optional package 'deep_ep' ({exc}): {_INSTALL_HINT}")
        ) from exc
    if not torch.cuda.is_available():
        raise ConfigError(
            ConfigIssue("backend.dispatcher", f"'deepep' runs on CUDA only and no GPU is visible: {_INSTALL_HINT}")
        )
    return deep_ep


class _BufferCache:
    """One DeepEP ``Buffer`` per process group, grown when a larger hidden size asks for more bytes."""

    def __init__(self, deep_ep: Any, group: dist.ProcessGroup) -> None:
        self.deep_ep = deep_ep
        self.group = group
        self.buffer = None

    def get(self, hidden: torch.Tensor) -> Any:
        buffer_cls = self.deep_ep.Buffer
        size = dist.get_world_size(self.group)
        hidden_bytes = hidden.shape[-1] * max(hidden.element_size(), 2)
        nvl = rdma = 0
        for config in (buffer_cls.get_dispatch_config(size), buffer_cls.get_combine_config(size)):
            nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, size))
            rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, size))
        if self.buffer is None or self.buffer.num_nvl_bytes < nvl or self.buffer.num_rdma_bytes < rdma:
            self.buffer = buffer_cls(self.group, nvl, rdma)
        return self.buffer


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, top_idx, top_weights, num_experts: int, buffers: _BufferCache):
        buffer = buffers.get(hidden)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(top_idx, num_experts)
        recv_x, recv_idx, recv_weights, _, handle, _ = buffer.dispatch(
            hidden,
            topk_idx=top_idx,
            topk_weights=top_weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        ctx.buffers, ctx.handle = buffers, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_weights, handle

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_weights, _grad_handle):
        buffer = ctx.buffers.get(grad_x)
        combined_x, combined_weights, _ = buffer.combine(
            grad_x.contiguous(), ctx.handle, topk_weights=grad_weights.float().contiguous()
        )
        return combined_x, None, combined_weights, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, per_token, handle, buffers: _BufferCache):
        buffer = buffers.get(per_token)
        combined, _, _ = buffer.combine(per_token.contiguous(), handle)
        ctx.buffers, ctx.handle = buffers, handle
        return combined

    @staticmethod
    def backward(ctx, grad):
        buffer = ctx.buffers.get(grad)
        recv_grad, *_ = buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return recv_grad, None, None


@dataclass
class DeepEPContext:
    handle: Any
    order: torch.Tensor  # expert-contiguous rows -> (received token, slot) pairs that live on this rank
    recv_weights: torch.Tensor  # [R, k] router weights of the received tokens (fp32, differentiable)
    num_received: int


class DeepEPDispatcher:
    """Same ``dispatch`` / ``combine`` contract as the torch dispatcher; the all-to-alls are DeepEP's kernels."""

    def __init__(self, *, group: dist.ProcessGroup, num_experts: int) -> None:
        deep_ep = import_deep_ep()
        self.group = group
        self.num_experts = num_experts
        self.num_local_experts = num_experts // dist.get_world_size(group)
        self.buffers = _BufferCache(deep_ep, group)

    def dispatch(
        self,
        hidden: torch.Tensor,
        top_idx: torch.Tensor,
        num_experts: int,
        top_scores: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DeepEPContext]:
        if top_scores is None:
            raise ValueError("the deepep dispatcher applies router weights on the expert side: pass top_scores")
        recv_x, recv_idx, recv_weights, handle = _Dispatch.apply(
            hidden.contiguous(), top_idx, top_scores.float().contiguous(), num_experts, self.buffers
        )
        k = recv_idx.shape[-1]
        # Slots whose expert lives on another rank (-1) go to a parking bucket past the last local expert.
        parked = torch.where(recv_idx >= 0, recv_idx, torch.full_like(recv_idx, self.num_local_experts))
        order, counts = sort_by_expert(parked, self.num_local_experts + 1)
        tokens_per_expert = counts[: self.num_local_experts]
        order = order[: int(tokens_per_expert.sum())]
        ctx = DeepEPContext(handle=handle, order=order, recv_weights=recv_weights, num_received=recv_x.shape[0])
        return permute_tokens(recv_x, order, k), tokens_per_expert, ctx

    def combine(self, expert_out: torch.Tensor, top_scores: torch.Tensor, ctx: DeepEPContext) -> torch.Tensor:
        k = ctx.recv_weights.shape[-1]
        weights = ctx.recv_weights.reshape(-1).index_select(0, ctx.order)
        weighted = expert_out.to(torch.float32) * weights.unsqueeze(-1)
        token = torch.div(ctx.order, k, rounding_mode="floor")
        per_token = weighted.new_zeros(ctx.num_received, expert_out.shape[-1]).index_add(0, token, weighted)
        return _Combine.apply(per_token.to(expert_out.dtype), ctx.handle, self.buffers)
