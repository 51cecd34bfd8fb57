"""Qwen3-MoE decoder (family ``qwen3_moe``) with transformers 5 parameter names.

``Qwen3MoeForCausalLM.state_dict()`` keys equal those of transformers' ``Qwen3MoeForCausalLM`` (model.embed_tokens,
model.layers.N.self_attn.{q,k,v,o}_proj / {q,k}_norm, model.layers.N.mlp.gate.weight,
model.layers.N.mlp.experts.{gate_up_proj,down_proj}, model.norm, lm_head), so HF checkpoints load by name.

Each ``DecoderLayer`` is self-contained (rope and attention metadata come in as arguments) so the parallelizer can
wrap it with activation checkpointing, torch.compile and fully_shard without touching the model.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models.common.decoder_layer import PreNormDecoderLayer, attention_from_config
from nemo_ac.models.common.rmsnorm import RMSNorm
from nemo_ac.models.common.rope import RotaryEmbedding
from nemo_ac.models.interfaces import AttentionInputs, ModelOutput, RouterStats


class DecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``; mlp is MoE unless ``layer_idx`` is dense.

    Families with the same block shape subclass it and set ``moe_class`` / ``o_proj_bias`` (GLM-4.5)."""

    # None: o_proj has a bias exactly when q/k/v do (``attention_bias``).
    o_proj_bias: ClassVar[bool | None] = None

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        attention = attention_from_config(cfg, norm_class=self.norm_class, o_proj_bias=self.o_proj_bias)
        super().__init__(cfg, layer_idx, mixer_name="self_attn", mixer=attention)


class Qwen3MoeModel(nn.Module):
    """Embedding, decoder layers, final norm. Returns the final hidden states and per-MoE-layer router stats."""

    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
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


class Qwen3MoeForCausalLM(nn.Module):
    """Causal LM head over ``Qwen3MoeModel``. ``self.config`` is the ``ModelConfig`` it was built from."""

    model_class: type[Qwen3MoeModel] = Qwen3MoeModel
    decoder_blocks_path = "model.layers"  # interfaces.ParallelizableModel

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.tie_weights()

    def decoder_blocks(self) -> nn.ModuleList:
        return self.model.layers

    def vision_blocks(self) -> nn.ModuleList | None:
        return None

    def tie_weights(self) -> None:
        """Share the embedding with the output projection (call again after ``to_empty``)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor, attn: AttentionInputs) -> ModelOutput:
        hidden, router_stats = self.model(input_ids, position_ids=position_ids, attn=attn)
        return ModelOutput(logits=self.lm_head(hidden), router_stats=router_stats)


def build_qwen3_moe(cfg: ModelConfig) -> Qwen3MoeForCausalLM:
    """Builder registered for family ``qwen3_moe``; rejects options that belong to other families."""
    unsupported = {
        "attn_output_gate": cfg.attn_output_gate,
        "layer_pattern": cfg.layer_pattern,
        "moe.latent_size": cfg.moe.latent_size,
    }
    bad = [f"model.{k}={v!r}" for k, v in unsupported.items() if v]
    if bad:
        raise NotImplementedError(f"family qwen3_moe does not support {', '.join(bad)}")
    return Qwen3MoeForCausalLM(cfg)
