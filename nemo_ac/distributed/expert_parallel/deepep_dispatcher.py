"""``backend.dispatcher: deepep``: DeepEP's fused all-to-all kernels (CUDA, NVLink within a node, RDMA across).

Written against DeepEP's public ``deep_ep.Buffer`` API (the V1 "normal" kernels, kept as ``Buffer`` in V2):
``get_dispatch_layout`` / ``dispatch`` / ``combine`` with a ``handle``. DeepEP sends each token once per destination
rank (not once per expert), with its top-k ids rewritten to local expert ids (-1: not here) and its router weights
(0 where -1); so the router weights are applied on the expert side, before the tokens go home, and their gradient
comes back through ``combine(..., topk_weights=)``. That is why ``MoE`` passes ``top_scores`` to ``dispatch``.

The communication runs in the ``nemo_ac::deepep_*`` custom ops (``deepep_ops``: what selective AC saves, how the
handle travels); this module sizes the buffers and does the expert-side permutation and weighting.

The Buffer implementation is a constructor argument (``buffer_cls``): ``deep_ep.Buffer`` by default, imported
lazily with the CUDA check; the tests pass ``tests/deepep_standin.GlooDeepEPBufferStandIn``, which implements
Buffer's documented semantics over gloo, to check this adapter against ``backend.dispatcher: torch`` on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nemo_ac.config.deepep import DEEPEP_INSTALL
from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.distributed.expert_parallel import deepep_ops
from nemo_ac.models.kernels.dispatch import TwoPhaseDispatch, permute_tokens, sort_by_expert


def import_deep_ep() -> Any:
    """The ``deep_ep`` module, or a ConfigError naming ``backend.dispatcher`` and how to install DeepEP."""
    try:
        import deep_ep
    except ImportError as exc:
        raise ConfigError(
            ConfigIssue(
                "backend.dispatcher",
                f"'deepep' needs DeepEP (the 'deep_ep' module: {exc}); {DEEPEP_INSTALL}, or set backend.dispatcher: "
                "torch",
            )
        ) from exc
    if not torch.cuda.is_available():
        raise ConfigError(
            ConfigIssue(
                "backend.dispatcher",
                "'deepep' runs DeepEP's CUDA kernels and no GPU is visible; run on CUDA devices or set "
                "backend.dispatcher: torch",
            )
        )
    return deep_ep


class DeepEPBuffers:
    """One ``Buffer`` per process group, re-made when a wider hidden size asks for more bytes (DeepEP's README
    recipe: the larger of the dispatch and combine configs' size hints)."""

    def __init__(self, buffer_cls: type, group: dist.ProcessGroup, *, topk_idx_dtype: torch.dtype) -> None:
        self.buffer_cls = buffer_cls
        self.group = group
        self.topk_idx_dtype = topk_idx_dtype
        self.buffer: Any = None

    def get(self, hidden: torch.Tensor) -> Any:
        size = dist.get_world_size(self.group)
        hidden_bytes = hidden.shape[-1] * max(hidden.element_size(), 2)
        nvl = rdma = 0
        for config in (self.buffer_cls.get_dispatch_config(size), self.buffer_cls.get_combine_config(size)):
            nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, size))
            rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, size))
        if self.buffer is None or self.buffer.num_nvl_bytes < nvl or self.buffer.num_rdma_bytes < rdma:
            self.buffer = self.buffer_cls(self.group, nvl, rdma)
        return self.buffer


def _dispatch(x, topk_idx, topk_weights, buffers_key: int, num_experts: int, async_finish: bool):
    return torch.ops.nemo_ac.deepep_dispatch(x, topk_idx, topk_weights, buffers_key, num_experts, async_finish)


class DispatchArrived(torch.autograd.Function):
    """After an asynchronous dispatch: the compute stream waits for it, the received rows pass through (views).

    Its backward issues the dispatch's backward transfer (a combine of the gradients, ``async_finish``) and returns
    at once; the dispatch op's own backward, which autograd runs after everything the forward computed between the
    dispatch and this wait (the shared expert's first projection: its backward), waits for the gradients
    (``deepep_ops``, "Asynchronous backward"). Without it that combine blocked the compute stream: 0.02 s of each
    micro batch, 0.08 s of the step, at Automodel's Nemotron Super shape (64 H100s, EP64, by the dry run)."""

    @staticmethod
    def forward(ctx, recv_x, recv_weights, handle, buffers_key: int, num_tokens: int):
        torch.ops.nemo_ac.deepep_dispatch_wait(handle)
        ctx.save_for_backward(handle)
        ctx.buffers_key, ctx.num_tokens = buffers_key, num_tokens
        return recv_x.view_as(recv_x), recv_weights.view_as(recv_weights)

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights):
        (handle,) = ctx.saved_tensors
        torch.ops.nemo_ac.deepep_dispatch_backward_start(
            grad_recv_x, grad_recv_weights, handle, ctx.buffers_key, ctx.num_tokens
        )
        return grad_recv_x, grad_recv_weights, None, None, None


class CombineArrived(torch.autograd.Function):
    """After an asynchronous combine: the compute stream waits for it, the combined rows pass through (a view). Its
    backward issues the combine's backward transfer (a dispatch of the gradients) asynchronously, as
    ``DispatchArrived``; the combine op's backward waits for it, after the shared expert's ``down_proj`` backward."""

    @staticmethod
    def forward(ctx, combined, handle, buffers_key: int, num_received: int):
        torch.ops.nemo_ac.deepep_combine_wait(handle)
        ctx.save_for_backward(handle)
        ctx.buffers_key, ctx.num_received = buffers_key, num_received
        return combined.view_as(combined)

    @staticmethod
    def backward(ctx, grad):
        (handle,) = ctx.saved_tensors
        torch.ops.nemo_ac.deepep_combine_backward_start(grad, handle, ctx.buffers_key, ctx.num_received)
        return grad, None, None, None


def _dispatch_arrived(recv_x, recv_weights, handle, buffers_key: int, num_tokens: int):
    return DispatchArrived.apply(recv_x, recv_weights, handle, buffers_key, num_tokens)


def _combine(x, handle, buffers_key: int, num_tokens: int, async_finish: bool):
    return torch.ops.nemo_ac.deepep_combine(x, handle, buffers_key, num_tokens, async_finish)


def _combine_arrived(combined, handle, buffers_key: int, num_received: int):
    return CombineArrived.apply(combined, handle, buffers_key, num_received)


# Under AC(compile(block)) (compile.layout ac_outer) every compiled graph runs as one region the SAC modes pass
# through and always recompute (workarounds.compiled_regions_under_sac): an op traced into it would communicate
# again in every recompute. Called through these, the ops run between compiled graphs, where the SAC modes save them.
_dispatch_between_graphs = torch.compiler.disable(_dispatch)
_dispatch_arrived_between_graphs = torch.compiler.disable(_dispatch_arrived)
_combine_between_graphs = torch.compiler.disable(_combine)
_combine_arrived_between_graphs = torch.compiler.disable(_combine_arrived)


@dataclass
class PendingDeepEP:
    """A dispatch in flight (``async_finish`` between compiled graphs): DeepEP's outputs, not to be read before
    ``dispatch_finish`` has waited for the handle's event."""

    recv_x: torch.Tensor
    recv_idx: torch.Tensor
    recv_weights: torch.Tensor
    handle: torch.Tensor
    num_tokens: int


@dataclass
class PendingCombine:
    """A combine in flight (``async_finish``): ``combined`` is not to be read before ``combine_finish``."""

    combined: torch.Tensor
    handle: torch.Tensor
    num_received: int


@dataclass
class DeepEPContext:
    handle: torch.Tensor  # the handle token (deepep_ops)
    order: torch.Tensor  # expert-contiguous rows -> (received token, slot) pairs that live on this rank
    recv_weights: torch.Tensor  # [R, k] router weights of the received tokens (fp32, differentiable)
    num_received: int
    num_tokens: int


class DeepEPDispatcher(TwoPhaseDispatch):
    """Same ``dispatch`` / ``combine`` contract as the torch dispatcher; the all-to-alls are DeepEP's kernels.

    between_compiled_graphs: call the ops outside compiled code (a graph break each), for blocks compiled inside
        their checkpoint (ac_outer); False traces them into the graph as single nodes (compile_outer: the policy
        is applied when the checkpoint is traced, so they are saved there too).
    buffer_cls: the ``Buffer`` implementation; None imports ``deep_ep.Buffer`` (CUDA only).

    Between compiled graphs every transfer is asynchronous (DeepEP's ``async_finish``). ``dispatch_start``
    returns while the tokens travel on DeepEP's stream, the shared expert's first projection runs on the compute
    stream, and ``dispatch_finish`` waits (``DispatchArrived``) before the first read of the received rows;
    ``combine_start`` returns while the expert rows go home, the shared expert's ``down_proj`` runs, and
    ``combine_finish`` waits (``CombineArrived``). The backward overlaps the same pairs the other way round (the two
    functions' docstrings). Traced into a graph the transfers stay synchronous: nothing orders a wait op there
    against the graph's other nodes.
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        num_experts: int,
        between_compiled_graphs: bool = True,
        buffer_cls: type | None = None,
    ) -> None:
        size = dist.get_world_size(group)
        if num_experts % size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the ep group size {size}")
        self.group = group
        self.num_experts = num_experts
        self.num_local_experts = num_experts // size
        topk_idx_dtype = torch.int64
        if buffer_cls is None:
            deep_ep = import_deep_ep()
            # V2 exports the dtype its layout kernel takes (int64 unless built with EP_NUM_TOPK_IDX_BITS); V1: int64.
            buffer_cls, topk_idx_dtype = deep_ep.Buffer, getattr(deep_ep, "topk_idx_t", torch.int64)
        self.buffers = DeepEPBuffers(buffer_cls, group, topk_idx_dtype=topk_idx_dtype)
        self.buffers_key = deepep_ops.register_buffers(self.buffers)
        self._dispatch_op = _dispatch_between_graphs if between_compiled_graphs else _dispatch
        self._combine_op = _combine_between_graphs if between_compiled_graphs else _combine
        self.async_dispatch = between_compiled_graphs

    def dispatch_start(
        self,
        hidden: torch.Tensor,
        top_idx: torch.Tensor,
        num_experts: int,
        top_scores: torch.Tensor | None = None,
    ) -> PendingDeepEP:
        if top_scores is None:
            raise ValueError("the deepep dispatcher applies router weights on the expert side: pass top_scores")
        if num_experts != self.num_experts:
            raise ValueError(f"dispatcher built for {self.num_experts} experts, called with {num_experts}")
        recv_x, recv_idx, recv_weights, handle = self._dispatch_op(
            hidden.contiguous(),
            top_idx,
            top_scores.float().contiguous(),
            self.buffers_key,
            num_experts,
            self.async_dispatch,
        )
        return PendingDeepEP(recv_x, recv_idx, recv_weights, handle, num_tokens=hidden.shape[0])

    def dispatch_finish(self, pending: PendingDeepEP) -> tuple[torch.Tensor, torch.Tensor, DeepEPContext]:
        recv_x, recv_idx, recv_weights, handle = pending.recv_x, pending.recv_idx, pending.recv_weights, pending.handle
        if self.async_dispatch:
            recv_x, recv_weights = _dispatch_arrived_between_graphs(
                recv_x, recv_weights, handle, self.buffers_key, pending.num_tokens
            )
        k = recv_idx.shape[-1]
        # Slots whose expert lives on another rank (-1) go to a parking bucket past the last local expert.
        parked = torch.where(recv_idx >= 0, recv_idx, torch.full_like(recv_idx, self.num_local_experts))
        order, counts = sort_by_expert(parked, self.num_local_experts + 1)
        tokens_per_expert = counts[: self.num_local_experts]
        order = order[: self.rows_here(tokens_per_expert)]
        ctx = DeepEPContext(
            handle=handle,
            order=order,
            recv_weights=recv_weights,
            num_received=recv_x.shape[0],
            num_tokens=pending.num_tokens,
        )
        return permute_tokens(recv_x, order, k), tokens_per_expert, ctx

    def rows_here(self, tokens_per_expert: torch.Tensor) -> int:
        """The (token, expert) rows of this rank's experts: a device-to-host sync, the one of a dispatch (the dry run
        answers it from its routing assumption)."""
        return int(tokens_per_expert.sum())

    def combine_start(self, expert_out: torch.Tensor, top_scores: torch.Tensor, ctx: DeepEPContext) -> PendingCombine:
        """Weights each expert row by its router weight (fp32), sums a received token's rows, sends the sums home."""
        k = ctx.recv_weights.shape[-1]
        weights = ctx.recv_weights.reshape(-1).index_select(0, ctx.order)
        weighted = expert_out.to(torch.float32) * weights.unsqueeze(-1)
        token = torch.div(ctx.order, k, rounding_mode="floor")
        per_token = weighted.new_zeros(ctx.num_received, expert_out.shape[-1]).index_add(0, token, weighted)
        combined = self._combine_op(
            per_token.to(expert_out.dtype), ctx.handle, self.buffers_key, ctx.num_tokens, self.async_dispatch
        )
        return PendingCombine(combined, ctx.handle, num_received=ctx.num_received)

    def combine_finish(self, pending: PendingCombine) -> torch.Tensor:
        if not self.async_dispatch:
            return pending.combined
        return _combine_arrived_between_graphs(pending.combined, pending.handle, self.buffers_key, pending.num_received)

    def combine(self, expert_out: torch.Tensor, top_scores: torch.Tensor, ctx: DeepEPContext) -> torch.Tensor:
        return self.combine_finish(self.combine_start(expert_out, top_scores, ctx))
