"""Mixture-of-Experts feed-forward: router -> dispatcher -> grouped experts -> combine (+ shared expert).

Submodule names follow transformers (``gate``, ``experts``, ``shared_expert``, ``shared_expert_gate``) so
checkpoints load by name. ``dispatcher`` is a plain attribute: ``LocalDispatcher`` by default, replaced by the
expert-parallel dispatcher in ``nemo_ac.distributed``; both implement ``dispatch`` / ``combine``.

Families whose shared expert or latent projection differ (GLM-4.5's ``shared_experts``, Nemotron-H's squared-ReLU
shared experts and ``fc1/fc2_latent_proj``) subclass ``MoE`` and override the three hooks ``project_in``,
``project_out`` and ``shared_mlp``; ``gate`` / ``experts`` / ``dispatcher`` and ``forward`` stay common, so the
parallelizer treats every family alike.

The shared expert runs in two parts (``shared_start`` / ``shared_finish``). Where the transfers are asynchronous
(``TwoPhaseDispatch.async_dispatch``: DeepEP between compiled graphs), everything before its ``down_proj`` runs between
the dispatch's start and finish, where it reads no routed row and so runs while the tokens travel, and its
``down_proj`` between the combine's start and finish, while the expert rows go home; the backward overlaps the same
pairs (``deepep_dispatcher.DispatchArrived``); a full-AC recompute there runs up to the combine's wait (its node
saves the handle), the ``down_proj`` included. Elsewhere the shared expert runs after the combine, its ``down_proj``
last: a full-AC recompute stops once every tensor the backward needs is back (``torch.utils.checkpoint``'s early
stop), so the block's last GEMM is never run again. Run whole before the dispatch's finish, the shared expert's
``down_proj`` was recomputed in the latent projection's place: Nemotron Super's step at Automodel's benchmark shape
recomputed 0.06 s more GEMMs than the dispatch it hid.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from nemo_ac.config.schema import MoEConfig
from nemo_ac.models.interfaces import RouterStats
from nemo_ac.models.kernels.dispatch import (
    LocalDispatchContext,
    LocalDispatcher,
    count_per_expert,
    inverse_permutation,
    permute_tokens,
    sort_by_expert,
    unpermute_tokens,
    weighted_combine,
)
from nemo_ac.models.layers.experts import GroupedExperts
from nemo_ac.models.layers.mlp import MLP, NonGatedMLP
from nemo_ac.models.layers.router import TopKRouter

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
    """What ``MoE`` needs from a dispatcher (local or expert-parallel): ``kernels.dispatch.TwoPhaseDispatch``."""

    async_dispatch: bool

    def dispatch_start(
        self, hidden: torch.Tensor, top_idx: torch.Tensor, num_experts: int, top_scores: torch.Tensor | None = None
    ) -> Any: ...

    def dispatch_finish(self, pending: Any) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, expert_out: torch.Tensor, top_scores: torch.Tensor, ctx: Any) -> torch.Tensor: ...

    def combine_start(self, expert_out: torch.Tensor, top_scores: torch.Tensor, ctx: Any) -> Any: ...

    def combine_finish(self, pending: Any) -> torch.Tensor: ...


class MoE(nn.Module):
    """Routed experts plus optional shared expert. ``forward(x [B, S, H]) -> (out [B, S, H], RouterStats)``."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        *,
        experts: GroupedExperts | None = None,
        with_shared_expert: bool = True,
    ) -> None:
        """``experts`` / ``with_shared_expert=False`` let family subclasses supply their own expert weights
        (e.g. latent width, HF parameter names) and shared-expert module instead of the Qwen-style ones."""
        super().__init__()
        if moe.latent_size and experts is None:
            raise NotImplementedError("MoE latent projection (latent_size > 0) exists only in family nemotron_h")
        self.hidden_size = hidden_size
        self.num_experts = moe.num_experts
        self.gate = TopKRouter.from_config(hidden_size, moe)
        self.experts = (
            experts
            if experts is not None
            else GroupedExperts(
                moe.num_experts,
                hidden_size,
                moe.moe_intermediate_size,
                activation=moe.activation,
                impl=moe.experts_impl,
            )
        )
        self.shared_expert = (
            MLP(hidden_size, moe.shared_expert_intermediate_size)
            if with_shared_expert and moe.shared_expert_intermediate_size > 0
            else None
        )
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False) if self.shared_expert is not None and moe.shared_expert_gate else None
        )
        self.dispatcher: Dispatcher = LocalDispatcher()

    # interfaces.RoutedMoE
    def router_module(self) -> nn.Module:
        return self.gate

    def experts_module(self) -> nn.Module:
        return self.experts

    def set_dispatcher(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def project_in(self, flat: torch.Tensor) -> torch.Tensor:
        """Tokens [T, H] -> what the experts take (identity; a latent down-projection in Nemotron-H). Runs before
        dispatch, so an expert-parallel all-to-all moves the (narrower) projected rows."""
        return flat

    def project_out(self, routed: torch.Tensor) -> torch.Tensor:
        """Combined expert output -> [T, H] (identity; the latent up-projection in Nemotron-H)."""
        return routed

    def shared_mlp(self) -> MLP | NonGatedMLP | None:
        """The shared expert (an MLP with ``hidden`` and ``down_proj``), or None."""
        return self.shared_expert

    def shared_start(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The shared expert up to its ``down_proj`` (module docstring), or None without one."""
        mlp = self.shared_mlp()
        return None if mlp is None else mlp.hidden(flat)

    def shared_finish(self, flat: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Shared-expert output [T, H] added to the routed output (Qwen: optionally sigmoid-gated)."""
        shared = self.shared_mlp().down_proj(hidden)  # type: ignore[union-attr]
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
        return shared

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        token_shape = x.shape  # a per-batch size under compile: workarounds.dynamic_per_batch_ints names it
        flat = x.reshape(-1, self.hidden_size)
        top_scores, top_idx, probs = self.gate(flat)
        pending = self.dispatcher.dispatch_start(
            self.project_in(flat), top_idx, self.num_experts, top_scores=top_scores
        )
        # While an asynchronous dispatch is in flight: the shared expert up to its last projection (module docstring).
        overlap = self.dispatcher.async_dispatch
        shared_hidden = self.shared_start(flat) if overlap else None
        rows, tokens_per_expert, ctx = self.dispatcher.dispatch_finish(pending)
        expert_out = self.experts(rows, tokens_per_expert)
        if overlap:  # the shared expert's down_proj while the expert rows go home
            combining = self.dispatcher.combine_start(expert_out, top_scores, ctx)
            shared = self.shared_finish(flat, shared_hidden) if shared_hidden is not None else None
            out = self.project_out(self.dispatcher.combine_finish(combining))
        else:
            out = self.project_out(self.dispatcher.combine(expert_out, top_scores, ctx))
            shared_hidden = self.shared_start(flat)
            shared = self.shared_finish(flat, shared_hidden) if shared_hidden is not None else None
        if shared is not None:
            out = out + shared
        stats = RouterStats(
            tokens_per_expert=count_per_expert(top_idx.detach(), self.num_experts).float(),
            prob_sum=probs.sum(dim=0),
            num_tokens=flat.shape[0],
        )
        return out.view(token_shape), stats
