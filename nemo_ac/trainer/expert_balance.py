"""Aux-loss-free load balancing in the loop (``model.moe.bias_update_rate > 0``).

After every optimizer step the trainer calls each ``LoopOptions.post_step_callbacks`` entry with
``info["expert_load"]``: the [MoE layers, experts] assignment counts of the whole step, summed over its micro
batches, each micro batch's counts already all-reduced over every rank that routes tokens (``trainer.loss``). So
every rank applies the same ``bias += rate * sign(mean_load - load)`` (``models.expert_bias``) to its replica of
each router's ``e_score_correction_bias`` and the replicas stay identical without a broadcast, at any dp x cp x ep.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from nemo_ac.config.schema import MoEConfig
from nemo_ac.models.expert_bias import biased_routers, update_expert_bias
from nemo_ac.trainer.loop import StepCallback


def expert_bias_callbacks(model: nn.Module, *, moe: MoEConfig) -> list[StepCallback]:
    """``[update]`` when ``moe.bias_update_rate > 0`` (empty otherwise)."""
    if moe.bias_update_rate <= 0:
        return []
    if not biased_routers(model):
        raise ValueError(
            "model.moe.bias_update_rate > 0 but no router has an e_score_correction_bias "
            "(set model.moe.score_correction_bias: true)"
        )

    def update(step: int, info: dict[str, Any]) -> None:
        load = info.get("expert_load")
        if load is None:
            raise RuntimeError(f"step {step}: no expert loads to update the router biases with (no MoE layer ran)")
        update_expert_bias(model, load, moe.bias_update_rate)

    return [update]
