"""Token-weighted cross entropy and the MoE load-balancing loss, exact under any dp x cp x ep layout.

Every rank returns its share: ``sum of its token losses / global label tokens``. Gradients are reduced as sums
(FSDP divide factor 1), so the total is the token-weighted mean of the global batch whatever the layout.
The load-balancing loss uses global expert loads (an all-reduce of detached counts) and this rank's router
probability sums, so that summing ranks gives exactly the single-process value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_ac.data.batch import IGNORE_INDEX
from nemo_ac.models.interfaces import ModelOutput, RouterStats


@dataclass
class LossParts:
    loss: torch.Tensor  # this rank's share, differentiable
    ce_sum: torch.Tensor  # detached sum of token cross entropies on this rank
    aux: torch.Tensor  # detached share of the load-balancing loss
    expert_load: torch.Tensor | None  # [layers, experts] global assignment counts (detached), for bias updates


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def global_expert_load(stats: list[RouterStats], group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """([layers, experts] assignment counts, total routed tokens) summed over ``group``; detached."""
    counts = torch.stack([s.tokens_per_expert.detach().float() for s in stats])
    tokens = torch.tensor([float(s.num_tokens) for s in stats], device=counts.device)
    packed = torch.cat([counts, tokens[:, None]], dim=1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, group=group)
    return packed[:, :-1], packed[:, -1]


def load_balancing_loss(stats: list[RouterStats], *, counts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Switch-style E * sum_e f_e * P_e, averaged over MoE layers; this rank's additive share."""
    prob_sum = torch.stack([s.prob_sum.float() for s in stats])  # [L, E], differentiable
    num_experts = prob_sum.shape[-1]
    fraction = counts / counts.sum(dim=-1, keepdim=True).clamp(min=1.0)
    per_layer = num_experts * (fraction * prob_sum).sum(dim=-1) / tokens.clamp(min=1.0)
    return per_layer.mean()


def compute_loss(
    output: ModelOutput,
    labels: torch.Tensor,
    *,
    num_global_label_tokens: int,
    num_micro_batches: int,
    aux_loss_coef: float,
    group: dist.ProcessGroup | None,
) -> LossParts:
    # A forward given the labels computed the cross entropy itself, over token chunks (train.loss_chunk_tokens).
    ce_sum = output.ce_sum if output.ce_sum is not None else cross_entropy_sum(output.logits, labels)
    loss = ce_sum / max(num_global_label_tokens, 1)
    aux = torch.zeros((), device=loss.device)
    load = None
    if output.router_stats:
        counts, tokens = global_expert_load(output.router_stats, group)
        load = counts
        if aux_loss_coef > 0:
            aux = load_balancing_loss(output.router_stats, counts=counts, tokens=tokens) / num_micro_batches
            loss = loss + aux_loss_coef * aux
    return LossParts(loss=loss, ce_sum=ce_sum.detach(), aux=aux.detach(), expert_load=load)
