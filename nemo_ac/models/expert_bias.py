"""Aux-loss-free load balancing (DeepSeek-V3 / GLM-4.5): nudge each router's ``e_score_correction_bias``.

The bias only changes which experts are *selected* (never the combine weights), so it is updated outside autograd,
after each optimizer step: ``bias += rate * sign(mean_load - load)`` per MoE layer, raising under-loaded experts and
lowering over-loaded ones by a fixed step. Loads must be global (all-reduced over every rank that routes tokens)
so that every replica of the bias receives the same update and stays identical without any broadcast.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from nemo_ac.models.layers.router import TopKRouter


def biased_routers(model: nn.Module) -> list[TopKRouter]:
    """Routers that carry an ``e_score_correction_bias``, in layer order (the order of ``ModelOutput.router_stats``
    for families whose MoE layers all have one: glm4_moe, nemotron_h)."""
    return [m for m in model.modules() if isinstance(m, TopKRouter) and m.e_score_correction_bias is not None]


@torch.no_grad()
def update_expert_bias(model: nn.Module, expert_load: torch.Tensor, rate: float) -> torch.Tensor:
    """Applies ``bias += rate * sign(mean_load - load)`` to every biased router of ``model``, in place.

    expert_load: [L, E] tokens routed to each expert of each biased MoE layer over the step (e.g. the stacked,
    all-reduced ``RouterStats.tokens_per_expert`` summed over micro batches). Returns the [L, E] update applied
    (fp32, on the load's device) for logging. ``rate == 0`` is a no-op.
    """
    routers = biased_routers(model)
    if expert_load.dim() != 2 or expert_load.shape[0] != len(routers):
        raise ValueError(
            f"expert_load must be [num_biased_moe_layers={len(routers)}, num_experts], got {tuple(expert_load.shape)}"
        )
    load = expert_load.detach().to(torch.float32)
    delta = rate * torch.sign(load.mean(dim=-1, keepdim=True) - load)
    for layer, router in enumerate(routers):
        bias = router.e_score_correction_bias
        assert bias is not None
        if bias.shape[-1] != load.shape[-1]:
            raise ValueError(f"router {layer} has {bias.shape[-1]} experts but expert_load has {load.shape[-1]}")
        if isinstance(bias, DTensor):
            if not all(isinstance(p, Replicate) for p in bias.placements):
                raise TypeError(f"router {layer}: e_score_correction_bias must be replicated, got {bias.placements}")
            bias = bias.to_local()
        bias.add_(delta[layer].to(device=bias.device, dtype=bias.dtype))
    return delta
