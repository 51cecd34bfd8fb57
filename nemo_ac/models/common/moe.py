"""Mixture-of-Experts feed-forward: router -> dispatcher -> grouped experts -> combine (+ shared expert).

Submodule names follow transformers (``gate``, ``experts``, ``shared_expert``, ``shared_expert_gate``) so
checkpoints load by name. ``dispatcher`` is a plain attribute: ``LocalDispatcher`` by default, replaced by the
expert-parallel dispatcher in ``nemo_ac.distributed``; both implement ``dispatch`` / ``combine``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from nemo_ac.config.schema import MoEConfig
from nemo_ac.models.common.dispatch import (
    LocalDispatchContext,
    LocalDispatcher,
    count_per_expert,
    inverse_permutation,
    permute_tokens,
    sort_by_expert,
    unpermute_tokens,
    weighted_combine,
)
from nemo_ac.models.common.experts import GroupedExperts
from nemo_ac.models.common.mlp import MLP
from nemo_ac.models.common.router import TopKRouter
from nemo_ac.models.interfaces import RouterStats

__all__ = [
    "MLP",
    "Dispatcher",
    "GroupedExperts",
    "LocalDispatchContext",
    "LocalDispatcher",
    "MoE",
    "TopKRouter",
    "count_per_expert",
    "inverse_permutation",
    "permute_tokens",
    "sort_by_expert",
    "unpermute_tokens",
    "weighted_combine",
]


class Dispatcher(Protocol):
    """What ``MoE`` needs from a dispatcher (local or expert-parallel)."""

    def dispatch(
        self, hidden: torch.Tensor, top_idx: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, expert_out: torch.Tensor, top_scores: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class MoE(nn.Module):
    """Routed experts plus optional shared expert. ``forward(x [B, S, H]) -> (out [B, S, H], RouterStats)``."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        if moe.latent_size:
            raise NotImplementedError("MoE latent projection (latent_size > 0, Nemotron-H) is not implemented yet")
        self.hidden_size = hidden_size
        self.num_experts = moe.num_experts
        self.gate = TopKRouter.from_config(hidden_size, moe)
        self.experts = GroupedExperts(
            moe.num_experts, hidden_size, moe.moe_intermediate_size, activation=moe.activation
        )
        self.shared_expert = (
            MLP(hidden_size, moe.shared_expert_intermediate_size) if moe.shared_expert_intermediate_size > 0 else None
        )
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False) if self.shared_expert is not None and moe.shared_expert_gate else None
        )
        self.dispatcher: Dispatcher = LocalDispatcher()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        flat = x.reshape(-1, self.hidden_size)
        top_scores, top_idx, probs = self.gate(flat)
        rows, tokens_per_expert, ctx = self.dispatcher.dispatch(flat, top_idx, self.num_experts)
        expert_out = self.experts(rows, tokens_per_expert)
        out = self.dispatcher.combine(expert_out, top_scores, ctx)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        stats = RouterStats(
            tokens_per_expert=count_per_expert(top_idx.detach(), self.num_experts).float(),
            prob_sum=probs.sum(dim=0),
            num_tokens=flat.shape[0],
        )
        return out.view(shape), stats
