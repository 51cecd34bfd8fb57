"""Nemotron-H / Nemotron 3 hybrid decoder (family ``nemotron_h``) with transformers 5 parameter names.

``NemotronHForCausalLM.state_dict()`` keys equal transformers 5.18's ``NemotronHForCausalLM``: model.embeddings,
model.layers.N.norm, model.layers.N.mixer.*, model.norm_f, lm_head. (Hub checkpoints say ``backbone.`` where
transformers says ``model.``; ``nemo_ac.trainer.checkpoint.hf_safetensors`` renames both ways.) Each layer is ONE
pre-norm residual block ``h + mixer(norm(h))`` whose mixer is chosen by ``ModelConfig.layer_pattern`` (HF
``hybrid_override_pattern``):

    M  Mamba-2 mixer            (``nemo_ac.models.layers.mamba2.Mamba2Mixer``, swappable ``ssm_op``)
    *  attention, no RoPE       (``Attention`` with ``rope=None``; no qk-norm, no biases, swappable ``attn_op``)
    E  MoE                      (sigmoid router + correction bias, squared-ReLU experts, shared experts, latent proj)
    -  dense squared-ReLU MLP

Layers follow ``qwen3_moe.DecoderLayer``'s contract: ``forward(hidden, *, rope, attn) -> (hidden, RouterStats |
None)`` (``rope`` is ignored: Nemotron-H has no positional encoding) and ``is_moe``. transformers names every
layer's module ``mixer``; the parallelizer reaches an E layer's router, experts and dispatcher through
``routed_moe()`` (``nemo_ac.models.interfaces.DecoderBlock``), so no state-dict name changes. The decoder stack and
the LM head are ``common.causal_lm``'s ``DecoderStack`` and ``CausalLM`` under transformers' names (``embeddings``,
``norm_f``).
"""

from __future__ import annotations

import torch
from torch import nn

from nemo_ac.config.hf.nemotron_h import nemotron_h_problems
from nemo_ac.config.schema import ModelConfig, MoEConfig
from nemo_ac.models.interfaces import AttentionInputs, RouterStats
from nemo_ac.models.layers.causal_lm import CausalLM, DecoderStack
from nemo_ac.models.layers.decoder_layer import attention_from_config
from nemo_ac.models.layers.experts import GroupedExperts
from nemo_ac.models.layers.mamba2 import Mamba2Mixer
from nemo_ac.models.layers.mlp import NonGatedMLP
from nemo_ac.models.layers.moe import MoE
from nemo_ac.models.layers.rmsnorm import RMSNorm

# hybrid_override_pattern characters -> transformers 5 layer types.
BLOCK_TYPES = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}


class NemotronHRMSNorm(RMSNorm):
    """RMSNorm whose weight multiply stays in fp32 and only the product is cast back (transformers' NemotronH;
    differs from Qwen's order in bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * x32).to(x.dtype)


class NemotronHMoE(MoE):
    """Routed squared-ReLU experts (``experts.up_proj`` [E, I, L], ``experts.down_proj`` [E, L, I]) over the latent
    width L (``fc1_latent_proj`` before dispatch, ``fc2_latent_proj`` after combine; L = hidden without latent), plus
    always-on ``shared_experts``. Routing and shared experts see the full hidden state."""

    def __init__(self, hidden_size: int, moe: MoEConfig, *, mlp_bias: bool) -> None:
        width = moe.latent_size or hidden_size
        experts = GroupedExperts(
            moe.num_experts,
            width,
            moe.moe_intermediate_size,
            activation="relu2",
            in_proj_name="up_proj",
            impl=moe.experts_impl,
        )
        super().__init__(hidden_size, moe, experts=experts, with_shared_expert=False)
        self.shared_experts = NonGatedMLP(hidden_size, moe.shared_expert_intermediate_size, bias=mlp_bias)
        self.fc1_latent_proj = nn.Linear(hidden_size, width, bias=mlp_bias) if moe.latent_size else None
        self.fc2_latent_proj = nn.Linear(width, hidden_size, bias=mlp_bias) if moe.latent_size else None

    def project_in(self, flat: torch.Tensor) -> torch.Tensor:
        return self.fc1_latent_proj(flat) if self.fc1_latent_proj is not None else flat

    def project_out(self, routed: torch.Tensor) -> torch.Tensor:
        return self.fc2_latent_proj(routed) if self.fc2_latent_proj is not None else routed

    def shared_mlp(self) -> NonGatedMLP:
        return self.shared_experts


class NemotronHBlock(nn.Module):
    """``h + mixer(norm(h))`` with the mixer picked by ``layer_pattern[layer_idx]``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.block_type = BLOCK_TYPES[cfg.layer_pattern[layer_idx]]
        self.is_moe = self.block_type == "moe"
        self.norm = NemotronHRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer: nn.Module
        if self.block_type == "mamba":
            self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba, rms_norm_eps=cfg.rms_norm_eps)
        elif self.block_type == "attention":
            self.mixer = attention_from_config(cfg)  # the family check rules out qk-norm, biases and a gate
        elif self.block_type == "moe":
            self.mixer = NemotronHMoE(cfg.hidden_size, cfg.moe, mlp_bias=cfg.mlp_bias)
        else:
            self.mixer = NonGatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def routed_moe(self) -> NemotronHMoE | None:
        """interfaces.DecoderBlock: the routed MoE of an E layer (None for the others)."""
        return self.mixer if self.block_type == "moe" else None

    def forward(
        self, hidden: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor] | None, attn: AttentionInputs
    ) -> tuple[torch.Tensor, RouterStats | None]:
        x = self.norm(hidden)
        if self.block_type == "moe":
            out, stats = self.mixer(x)
            return hidden + out, stats
        if self.block_type == "mamba":
            return hidden + self.mixer(x, attn=attn), None
        if self.block_type == "attention":
            return hidden + self.mixer(x, rope=None, attn=attn), None
        return hidden + self.mixer(x), None


class NemotronHModel(DecoderStack):
    """Embeddings, hybrid layers, final norm (``norm_f``). No positional encoding: ``position_ids`` is unused."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(
            cfg,
            layers=(NemotronHBlock(cfg, i) for i in range(cfg.num_layers)),
            norm_class=NemotronHRMSNorm,
            rotary=None,
            embedding_name="embeddings",
            final_norm_name="norm_f",
        )


class NemotronHForCausalLM(CausalLM):
    """Causal LM head over ``NemotronHModel``. ``self.config`` is the ``ModelConfig`` it was built from."""

    model_class = NemotronHModel


def check_nemotron_h_config(cfg: ModelConfig) -> list[str]:
    """What in ``cfg`` this family cannot build, as ``model.<key>=<value> (reason)`` strings (empty: fine).

    The layer pattern is checked here (its characters index ``BLOCK_TYPES``); every other rule lives in
    ``nemo_ac.config.hf.nemotron_h`` (torch-free) so recipe validation rejects it before any process group starts.
    """
    bad = []
    pattern = cfg.layer_pattern
    if pattern and set(pattern) - set(BLOCK_TYPES):
        bad.append(f"model.layer_pattern={pattern!r} (needs characters from {''.join(BLOCK_TYPES)})")
    elif pattern and len(pattern) != cfg.num_layers:
        bad.append(f"model.layer_pattern has {len(pattern)} layers (model.num_layers={cfg.num_layers})")
    return bad + [problem.describe() for problem in nemotron_h_problems(cfg)]


def build_nemotron_h(cfg: ModelConfig) -> NemotronHForCausalLM:
    """Builder registered for family ``nemotron_h``; rejects settings the family does not have (no silent fixes)."""
    bad = check_nemotron_h_config(cfg)
    if bad:
        raise ValueError(f"family nemotron_h: {', '.join(bad)}")
    return NemotronHForCausalLM(cfg)
