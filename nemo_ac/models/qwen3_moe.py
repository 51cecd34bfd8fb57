"""Qwen3-MoE decoder (family ``qwen3_moe``) with transformers 5 parameter names.

``Qwen3MoeForCausalLM.state_dict()`` keys equal those of transformers' ``Qwen3MoeForCausalLM`` (model.embed_tokens,
model.layers.N.self_attn.{q,k,v,o}_proj / {q,k}_norm, model.layers.N.mlp.gate.weight,
model.layers.N.mlp.experts.{gate_up_proj,down_proj}, model.norm, lm_head), so HF checkpoints load by name.

Each ``DecoderLayer`` is self-contained (rope and attention metadata come in as arguments) so the parallelizer can
wrap it with activation checkpointing, torch.compile and fully_shard without touching the model. The block, the
decoder stack and the LM head are the shared ``PreNormDecoderLayer``, ``DecoderStack`` and ``CausalLM`` of
``nemo_ac.models.layers``; this module picks Qwen3's norm and rope (GLM-4.5 reuses all of it).
"""

from __future__ import annotations

from typing import ClassVar

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models.layers.causal_lm import CausalLM, DecoderStack
from nemo_ac.models.layers.decoder_layer import PreNormDecoderLayer, attention_from_config
from nemo_ac.models.layers.rmsnorm import RMSNorm
from nemo_ac.models.layers.rope import RotaryEmbedding


class DecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``; mlp is MoE unless ``layer_idx`` is dense.

    Families with the same block shape subclass it and set ``moe_class`` / ``o_proj_bias`` (GLM-4.5)."""

    # None: o_proj has a bias exactly when q/k/v do (``attention_bias``).
    o_proj_bias: ClassVar[bool | None] = None

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        attention = attention_from_config(cfg, norm_class=self.norm_class, o_proj_bias=self.o_proj_bias)
        super().__init__(cfg, layer_idx, mixer_name="self_attn", mixer=attention)


class Qwen3MoeModel(DecoderStack):
    """Embedding, decoder layers, final norm. Returns the final hidden states and per-MoE-layer router stats."""

    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(
            cfg,
            layers=(self.layer_class(cfg, i) for i in range(cfg.num_layers)),
            norm_class=RMSNorm,
            rotary=RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.partial_rotary_factor),
        )


class Qwen3MoeForCausalLM(CausalLM):
    """Causal LM head over ``Qwen3MoeModel``. ``self.config`` is the ``ModelConfig`` it was built from."""

    model_class = Qwen3MoeModel


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
