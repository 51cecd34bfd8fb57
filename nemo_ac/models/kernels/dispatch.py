"""Token dispatch / combine between the router and the grouped experts.

A dispatcher turns ``(hidden [T, H], top_idx [T, k])`` into expert-contiguous rows plus per-expert counts, and
turns the experts' output rows back into ``[T, H]`` weighted by the router scores. ``LocalDispatcher`` is the
single-process version; the expert-parallel all-to-all dispatcher implements the same two methods and is assigned
to ``moe.dispatcher`` by the parallelizer. The permutation helpers below are shared with it.

Row order convention: the ``T * k`` (token, slot) pairs are flattened token-major (pair ``p`` is token
``p // k``, slot ``p % k``); ``sort_by_expert`` orders them by expert id with a stable sort, so within an expert
the tokens keep their original order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def count_per_expert(top_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [E] int64. A scatter-add rather than ``bincount``: its output shape is static, so
    torch.compile traces it without a graph break (bincount's shape depends on the data)."""
    flat = top_idx.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def sort_by_expert(top_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(order [T*k], tokens_per_expert [E] int64)``: ``order[j]`` is the flat (token, slot) pair placed
    at expert-contiguous row ``j``."""
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens_per_expert = count_per_expert(flat, num_experts)
    return order, tokens_per_expert


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[j]] = j`` (a scatter; cheaper than a second argsort)."""
    inv = torch.empty_like(order)
    inv.scatter_(0, order, torch.arange(order.numel(), device=order.device, dtype=order.dtype))
    return inv


def permute_tokens(hidden: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Expert-contiguous copy [T*k, H] of ``hidden`` [T, H] (each token repeated once per chosen expert)."""
    return hidden.index_select(0, torch.div(order, top_k, rounding_mode="floor"))


def unpermute_tokens(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Inverse of the row order: [T*k, H] expert-contiguous -> [T*k, H] flat (token, slot) order."""
    return rows.index_select(0, inverse_permutation(order))


def _weighted_sum_fp32(rows: torch.Tensor, top_scores: torch.Tensor) -> torch.Tensor:
    """``sum_k rows[t, k] * scores[t, k]`` accumulated in fp32, returned in ``rows.dtype`` (autograd's form)."""
    t, k = top_scores.shape
    weighted = rows.view(t, k, -1).to(torch.float32) * top_scores.to(torch.float32).unsqueeze(-1)
    return weighted.sum(dim=1).to(rows.dtype)


_COMBINE_CHUNKS = 8


def _token_chunks(tokens: int) -> list[slice]:
    """At most ``_COMBINE_CHUNKS`` slices of the tokens: the combine's fp32 temporaries are one chunk's, so at most
    an eighth of their unchunked size, for a fixed number of kernel launches whatever the size."""
    step = max(1, -(-tokens // _COMBINE_CHUNKS))
    return [slice(start, min(start + step, tokens)) for start in range(0, tokens, step)]


class _WeightedCombine(torch.autograd.Function):
    """``sum_k rows[t, k] * scores[t, k]`` in fp32, keeping ``rows`` in its own dtype for backward.

    Written with autograd's ops, the fp32 product saved the fp32 upcast of every expert output row for the scores'
    gradient: with bf16 rows that is 2x the rows' bytes (16 MiB on Qwen3.6's MoE FFN row at 1024 tokens where
    transformers keeps its 8 MiB bf16 rows). The backward casts inside and computes what autograd computed.

    Forward and backward run over token chunks (``_token_chunks``): each token's result is the same op on the same
    values, only the fp32 temporaries shrink. Unchunked, the backward's fp32 [T, H] gradient and product (16 MiB
    each at Qwen3.6's bf16 MoE row, 2048 tokens) set that row's peak at 1.04x transformers', whose bf16 combine
    makes none; the forward's fp32 [T, k, H] upcast and product came second, at 1.00x.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, rows: torch.Tensor, top_scores: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, top_scores)
        t, k = top_scores.shape
        slots = rows.view(t, k, -1)
        out = rows.new_empty(t, slots.shape[-1])
        for chunk in _token_chunks(t):
            out[chunk] = _weighted_sum_fp32(slots[chunk].reshape(-1, slots.shape[-1]), top_scores[chunk])
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, top_scores = ctx.saved_tensors
        t, k = top_scores.shape
        slots = rows.view(t, k, -1)
        scores32 = top_scores.to(torch.float32).unsqueeze(-1)  # [T, k, 1]
        grad_rows = torch.empty_like(slots) if ctx.needs_input_grad[0] else None
        grad_scores = torch.empty_like(top_scores) if ctx.needs_input_grad[1] else None
        for chunk in _token_chunks(t):
            grad32 = grad_out[chunk].to(torch.float32).unsqueeze(1)  # [c, 1, H]: autograd's ToCopy + Sum backward
            if grad_rows is not None:
                grad_rows[chunk] = grad32 * scores32[chunk]
            if grad_scores is not None:
                grad_scores[chunk] = (grad32 * slots[chunk].to(torch.float32)).sum(dim=-1)
        if grad_rows is not None:
            grad_rows = grad_rows.view(t * k, -1)
        return grad_rows, grad_scores


def weighted_combine(rows: torch.Tensor, top_scores: torch.Tensor) -> torch.Tensor:
    """Sum of the k expert outputs per token weighted by the router scores, accumulated in fp32.

    rows: [T*k, H] in flat (token, slot) order; top_scores: [T, k]. Returns [T, H] in ``rows.dtype``. Keeps
    ``rows`` (not an fp32 copy) for backward (``_WeightedCombine``) when it runs eagerly.
    Inside a compiled graph the autograd form is traced instead: there AOTAutograd's partitioner decides what is
    saved, and a custom ``autograd.Function`` makes torch 2.13 bypass AOTAutograd's cache for the whole graph
    (counter ``autograd_cache_bypass``): a warm ``make run`` then re-traced its MoE graphs.
    """
    if torch.compiler.is_compiling():
        return _weighted_sum_fp32(rows, top_scores)
    return _WeightedCombine.apply(rows, top_scores)


@dataclass
class LocalDispatchContext:
    """What ``combine`` needs from ``dispatch``."""

    order: torch.Tensor


class TwoPhaseDispatch:
    """``dispatch`` as two calls, so that work which needs no routed rows runs while they travel: ``dispatch_start``
    sends them (an expert-parallel dispatcher's communication is issued here) and returns what is pending;
    ``dispatch_finish`` is the first code that reads what arrived (an asynchronous transfer is waited for here) and
    returns ``(rows, tokens_per_expert, ctx)``. ``MoE.forward`` runs the shared expert between the two where
    ``async_dispatch`` says the transfer runs beside the compute stream (elsewhere the shared expert's output would
    only live longer: GLM-4.5-Air's peak grew 0.3 GiB); there the combine is two calls as well (``combine_start`` /
    ``combine_finish``), with the shared expert's ``down_proj`` between."""

    async_dispatch: bool = False

    def dispatch_start(
        self, hidden: torch.Tensor, top_idx: torch.Tensor, num_experts: int, top_scores: torch.Tensor | None = None
    ) -> Any:
        raise NotImplementedError

    def dispatch_finish(self, pending: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def dispatch(
        self, hidden: torch.Tensor, top_idx: torch.Tensor, num_experts: int, top_scores: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Both phases at once."""
        return self.dispatch_finish(self.dispatch_start(hidden, top_idx, num_experts, top_scores=top_scores))

    def combine(self, expert_out: torch.Tensor, top_scores: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError

    def combine_start(self, expert_out: torch.Tensor, top_scores: torch.Tensor, ctx: Any) -> Any:
        """The combine in two calls, as the dispatch (``combine_finish`` is the first read of what came home); here
        both at once, ``combine_finish`` returning the result."""
        return self.combine(expert_out, top_scores, ctx)

    def combine_finish(self, pending: Any) -> torch.Tensor:
        return pending


class LocalDispatcher(TwoPhaseDispatch):
    """Single-process dispatcher: a sort by expert id and its inverse, no communication (nothing in flight: the
    start does the whole dispatch)."""

    def dispatch_start(
        self, hidden: torch.Tensor, top_idx: torch.Tensor, num_experts: int, top_scores: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchContext]:
        """``top_scores`` is unused here (``combine`` weights); dispatchers that weight on the expert side need it."""
        order, tokens_per_expert = sort_by_expert(top_idx, num_experts)
        return permute_tokens(hidden, order, top_idx.shape[-1]), tokens_per_expert, LocalDispatchContext(order)

    def dispatch_finish(
        self, pending: tuple[torch.Tensor, torch.Tensor, LocalDispatchContext]
    ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchContext]:
        return pending

    def combine(self, expert_out: torch.Tensor, top_scores: torch.Tensor, ctx: LocalDispatchContext) -> torch.Tensor:
        return weighted_combine(unpermute_tokens(expert_out, ctx.order), top_scores)
