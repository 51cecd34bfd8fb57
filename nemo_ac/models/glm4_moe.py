"""GLM-4.5 / GLM-4.5-Air decoder (family ``glm4_moe``) with transformers 5 parameter names.

``Glm4MoeForCausalLM.state_dict()`` keys equal those of transformers' ``Glm4MoeForCausalLM``:
model.embed_tokens, model.layers.N.self_attn.{q,k,v}_proj (+ .bias with ``attention_bias``; o_proj never has one),
{q,k}_norm with ``qk_norm`` (HF ``use_qk_norm``), model.layers.N.mlp.{gate_proj,up_proj,down_proj} for the first
``first_k_dense_replace`` layers, then model.layers.N.mlp.gate.{weight,e_score_correction_bias},
model.layers.N.mlp.experts.{gate_up_proj,down_proj}, model.layers.N.mlp.shared_experts.{gate,up,down}_proj,
model.norm, lm_head.

Routing is DeepSeek-V3 style: sigmoid scores, ``e_score_correction_bias`` added for selection only, grouped top-k
(``n_group`` / ``topk_group``), optional renormalization, ``routed_scaling_factor``. The bias is trained without an
aux loss by ``nemo_ac.models.expert_bias.update_expert_bias``. Layers follow ``qwen3_moe.DecoderLayer``'s contract
(``forward(hidden, *, rope, attn) -> (hidden, RouterStats | None)``, ``is_moe``, MoE at ``layer.mlp``).
"""

from __future__ import annotations

import torch
from torch import nn

from nemo_ac.config.schema import ModelConfig, MoEConfig
from nemo_ac.models.common.attention import Attention
from nemo_ac.models.common.mlp import MLP
from nemo_ac.models.common.moe import MoE
from nemo_ac.models.common.rmsnorm import RMSNorm
from nemo_ac.models.common.rope import RotaryEmbedding
from nemo_ac.models.interfaces import AttentionInputs, ModelOutput, RouterStats


class Glm4MoeMoE(MoE):
    """Routed experts plus GLM's always-on ``shared_experts`` (one SwiGLU of width n_shared * moe_intermediate)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__(hidden_size, moe, with_shared_expert=False)
        self.shared_experts = (
            MLP(hidden_size, moe.shared_expert_intermediate_size) if moe.shared_expert_intermediate_size > 0 else None
        )

    def shared_output(self, flat: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts(flat) if self.shared_experts is not None else None


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``; dense MLP below first_k_dense_replace."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = layer_idx >= cfg.first_k_dense_replace
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qk_norm=cfg.qk_norm,
            attention_bias=cfg.attention_bias,
            rms_norm_eps=cfg.rms_norm_eps,
            o_proj_bias=False,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            Glm4MoeMoE(cfg.hidden_size, cfg.moe) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(
        self, hidden: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionInputs
    ) -> tuple[torch.Tensor, RouterStats | None]:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope=rope, attn=attn)
        mlp_in = self.post_attention_layernorm(hidden)
        if self.is_moe:
            mlp_out, stats = self.mlp(mlp_in)
            return hidden + mlp_out, stats
        return hidden + self.mlp(mlp_in), None


class Glm4MoeModel(nn.Module):
    """Embedding, decoder layers, final norm; rotary embedding over ``partial_rotary_factor`` of each head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.partial_rotary_factor)

    def forward(
        self, input_ids: torch.Tensor, *, position_ids: torch.Tensor, attn: AttentionInputs
    ) -> tuple[torch.Tensor, list[RouterStats]]:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(position_ids, dtype=hidden.dtype)
        router_stats: list[RouterStats] = []
        for layer in self.layers:
            hidden, stats = layer(hidden, rope=rope, attn=attn)
            if stats is not None:
                router_stats.append(stats)
        return self.norm(hidden), router_stats


class Glm4MoeForCausalLM(nn.Module):
    """Causal LM head over ``Glm4MoeModel``. ``self.config`` is the ``ModelConfig`` it was built from."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Glm4MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection (call again after ``to_empty``)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor, attn: AttentionInputs) -> ModelOutput:
        hidden, router_stats = self.model(input_ids, position_ids=position_ids, attn=attn)
        return ModelOutput(logits=self.lm_head(hidden), router_stats=router_stats)


def check_glm4_moe_config(cfg: ModelConfig) -> list[str]:
    """What in ``cfg`` this family cannot build, as ``model.<key>=<value> (reason)`` strings (empty: fine).

    GLM's router is always sigmoid with a score-correction bias (transformers has no other mode), so a config that
    says otherwise is an error rather than silently overridden; options of other families are rejected too.
    """
    moe = cfg.moe
    needs = {
        "moe.score_func": (moe.score_func, "sigmoid"),
        "moe.score_correction_bias": (moe.score_correction_bias, True),
        "moe.activation": (moe.activation, "silu"),
    }
    bad = [f"model.{k}={got!r} (needs {want!r})" for k, (got, want) in needs.items() if got != want]
    unsupported = {
        "attn_output_gate": cfg.attn_output_gate,
        "layer_pattern": cfg.layer_pattern,
        "moe.latent_size": moe.latent_size,
        "moe.shared_expert_gate": moe.shared_expert_gate,
        "mlp_bias": cfg.mlp_bias,
    }
    bad += [f"model.{k}={v!r} (not in glm4_moe)" for k, v in unsupported.items() if v]
    return bad


def build_glm4_moe(cfg: ModelConfig) -> Glm4MoeForCausalLM:
    """Builder registered for family ``glm4_moe``; rejects settings the family does not have (no silent fixes)."""
    bad = check_glm4_moe_config(cfg)
    if bad:
        raise ValueError(f"family glm4_moe: {', '.join(bad)}")
    return Glm4MoeForCausalLM(cfg)
