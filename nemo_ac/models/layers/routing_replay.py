"""The recompute of an activation checkpoint reuses the forward's routing: the router never chooses twice.

Why: under activation checkpointing the recompute runs the block's forward again, router included. When the router
comes out differently there (a non-deterministic reduction in the router GEMM, router noise, an expert bias changed
in between, a tie broken another way), the tokens go to other experts:

- with expert parallel the all-to-all split sizes change, and the run dies with::

      torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the following tensors
      have different metadata than during the forward pass.

  or hangs, when ranks disagree on how much to exchange (NeMo Automodel users hit this as "CheckpointError from
  dispatch token-count drift" with MoE + EP + full AC);
- without it, the recompute's saved tensors no longer match the forward's graph and the gradients are silently
  wrong (``tests/unit/models/layers/test_routing_replay.py`` measures both).

How: the router's expert choice is one custom op, ``nemo_ac::select_experts`` (scores in, top-k expert ids out),
opaque to Dynamo and inductor, so its Python body runs at run time even inside a compiled block. The checkpoint's
``context_fn`` (``routing_replay_context``, added by the parallelizer to every checkpointed MoE block) opens a
``RoutingRecord`` per checkpoint invocation: during the forward each ``select_experts`` call appends its ids;
during the recompute (on whichever thread runs it) each call returns the recorded ids in order instead of choosing.
The expert weights are still gathered from the recomputed scores (``scores.gather(1, ids)``) so the router's
gradient flows as before; with the same ids every shape, split size and dispatch in the recompute equals the
forward's by construction. Cost: the ids, ``[tokens, top_k]`` int64 per MoE block, held from forward to backward
(256 KB for 4k tokens at top-8). Saved: the selection itself in the recompute (bias-corrected, grouped top-k).

Under selective AC the SAC policy saves ``aten::topk`` outside compiled code already; the record covers the
rest (full AC, AC(compile(block)) whose compiled regions SAC recomputes whole). compile(AC(block)) traces the
checkpoint: there the context is a SAC policy that saves this op's output (the partitioner keeps it instead of
recomputing it in the backward graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from nemo_ac.models.kernels.op_flops import register_op_flops, zero_flops

Phase = Literal["forward", "recompute"]


@dataclass
class RoutingRecord:
    """One checkpoint invocation's routing decisions, in call order."""

    decisions: list[torch.Tensor] = field(default_factory=list)
    replayed: int = 0

    def record(self, ids: torch.Tensor) -> torch.Tensor:
        self.decisions.append(ids)
        return ids

    def replay(self, *, tokens: int, top_k: int) -> torch.Tensor:
        if self.replayed >= len(self.decisions):
            raise RuntimeError(
                f"nemo_ac routing replay: the recompute asked for routing decision {self.replayed + 1} but the "
                f"forward made {len(self.decisions)}; the checkpointed block routes a different number of times in "
                "its recompute"
            )
        ids = self.decisions[self.replayed]
        if tuple(ids.shape) != (tokens, top_k):
            raise RuntimeError(
                f"nemo_ac routing replay: decision {self.replayed + 1} was [{ids.shape[0]}, {ids.shape[1]}] in the "
                f"forward and is asked for as [{tokens}, {top_k}] in the recompute"
            )
        self.replayed += 1
        return ids


_ACTIVE: ContextVar[tuple[Phase, RoutingRecord] | None] = ContextVar("nemo_ac_routing_replay", default=None)


@contextlib.contextmanager
def _routing_phase(phase: Phase, record: RoutingRecord) -> Iterator[None]:
    token = _ACTIVE.set((phase, record))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def choose_experts(
    scores: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, n_group: int, topk_group: int
) -> torch.Tensor:
    """Expert ids [T, k] chosen on (bias-corrected) scores, restricted to the best ``topk_group`` of ``n_group``
    groups if grouped (GLM-4.5 / DeepSeek-V3). The choice the router makes; no gradient."""
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    if n_group > 1:
        t, num_experts = choice.shape
        grouped = choice.view(t, n_group, num_experts // n_group)
        k_in_group = min(2, grouped.shape[-1])
        group_scores = grouped.topk(k_in_group, dim=-1).values.sum(-1)
        group_idx = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = group_mask.unsqueeze(-1).expand_as(grouped).reshape(t, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    return choice.topk(top_k, dim=-1).indices


@torch.library.custom_op("nemo_ac::select_experts", mutates_args=())
def _select_experts_op(
    scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int
) -> torch.Tensor:
    active = _ACTIVE.get()
    if active is not None and active[0] == "recompute":
        return active[1].replay(tokens=scores.shape[0], top_k=top_k).clone()
    ids = choose_experts(scores, bias, top_k=top_k, n_group=n_group, topk_group=topk_group)
    if active is not None:
        active[1].record(ids.clone())
    return ids


@_select_experts_op.register_fake
def _(scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    return scores.new_empty(scores.shape[0], top_k, dtype=torch.int64)


register_op_flops(torch.ops.nemo_ac.select_experts, zero_flops)  # a top-k choice: no matmul work


def select_experts(
    scores: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, n_group: int, topk_group: int
) -> torch.Tensor:
    """The router's expert choice as one op (recorded in a checkpoint's forward, replayed in its recompute)."""
    return torch.ops.nemo_ac.select_experts(scores.detach(), bias, top_k, n_group, topk_group)


def _save_selection_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.nemo_ac.select_experts.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def routing_replay_context() -> tuple[AbstractContextManager, AbstractContextManager]:
    """A checkpoint ``context_fn``: record the routing in the forward, replay it in the recompute.

    When the checkpoint itself is being traced (compile(AC(block))) the context is torch's SAC pair with a policy
    that saves ``nemo_ac::select_experts`` and recomputes everything else (what full AC does), so the compiled
    backward reuses the forward's ids too.
    """
    if torch.compiler.is_compiling():
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return create_selective_checkpoint_contexts(_save_selection_policy)
    record = RoutingRecord()
    return _routing_phase("forward", record), _routing_phase("recompute", record)
