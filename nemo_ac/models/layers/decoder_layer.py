"""The pieces a decoder layer of every family builds the same way: its softmax attention and its pre-norm block.

``attention_from_config`` is the one place that turns ``ModelConfig`` into an ``Attention`` (q/k/v/o projections
and their biases, per-head q/k norms, the Qwen3.5 output gate); rope is not built here: the model that owns the
rotary embedding computes ``(cos, sin)`` once per forward and passes it to every layer.

``PreNormDecoderLayer`` is the two-residual block of Qwen3-MoE, GLM-4.5 and Qwen3.5 (``h + mixer(norm(h))``, then
``h + mlp(norm(h))``) with transformers' module names, so state-dict keys are those of the HF checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models.interfaces import AttentionInputs, RouterStats
from nemo_ac.models.layers.attention import Attention
from nemo_ac.models.layers.mlp import MLP
from nemo_ac.models.layers.moe import MoE
from nemo_ac.models.layers.rmsnorm import RMSNorm

# (width, eps) -> norm module: RMSNorm, or a family's variant (zero-centered, fp32 weight multiply).
NormClass = Callable[[int, float], nn.Module]
Rope = tuple[torch.Tensor, torch.Tensor]


def attention_from_config(
    cfg: ModelConfig, *, norm_class: NormClass = RMSNorm, o_proj_bias: bool | None = None
) -> Attention:
    """The softmax attention of a decoder layer as ``cfg`` describes it (``qk_norm``, ``attention_bias``,
    ``attn_output_gate``); ``norm_class`` builds the q/k norms, ``o_proj_bias`` overrides the o_proj bias (GLM-4.5:
    False; None: as q/k/v). Nemotron-H's family check guarantees no qk-norm, bias or gate for its attention."""
    return Attention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        qk_norm=cfg.qk_norm,
        attention_bias=cfg.attention_bias,
        rms_norm_eps=cfg.rms_norm_eps,
        o_proj_bias=o_proj_bias,
        output_gate=cfg.attn_output_gate,
        norm_cls=norm_class,
    )


class PreNormDecoderLayer(nn.Module):
    """``h + mixer(norm(h))`` then ``h + mlp(norm(h))``; mlp is the routed MoE from ``first_k_dense_replace`` on,
    a dense SwiGLU below (interfaces.DecoderBlock).

    A family gives the mixer module and the name transformers registers it under (``self_attn``, ``linear_attn``),
    and sets ``norm_class`` / ``moe_class``; it overrides ``mix`` when its mixer is not called as attention is.
    Registration order (input norm, mixer, post norm, mlp) is transformers' and so the state-dict order.
    """

    norm_class: ClassVar[NormClass] = RMSNorm
    moe_class: ClassVar[type[MoE]] = MoE

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, mixer_name: str, mixer: nn.Module) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = layer_idx >= cfg.first_k_dense_replace
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.add_module(mixer_name, mixer)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            self.moe_class(cfg.hidden_size, cfg.moe) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def routed_moe(self) -> MoE | None:
        """interfaces.DecoderBlock: the routed MoE of this block (None: a dense block)."""
        return self.mlp if self.is_moe else None

    def mix(self, x: torch.Tensor, *, rope: Rope | None, attn: AttentionInputs) -> torch.Tensor:
        """The sequence mixer on the normed hidden states: softmax attention at ``self_attn``."""
        return self.self_attn(x, rope=rope, attn=attn)

    def forward(
        self, hidden: torch.Tensor, *, rope: Rope | None, attn: AttentionInputs
    ) -> tuple[torch.Tensor, RouterStats | None]:
        hidden = hidden + self.mix(self.input_layernorm(hidden), rope=rope, attn=attn)
        mlp_in = self.post_attention_layernorm(hidden)
        if self.is_moe:
            mlp_out, stats = self.mlp(mlp_in)
            return hidden + mlp_out, stats
        return hidden + self.mlp(mlp_in), None
