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

from nemo_ac.config.hf.glm4_moe import glm4_moe_problems
from nemo_ac.config.schema import ModelConfig, MoEConfig
from nemo_ac.models import qwen3_moe
from nemo_ac.models.layers.mlp import MLP
from nemo_ac.models.layers.moe import MoE


class Glm4MoeMoE(MoE):
    """Routed experts plus GLM's always-on ``shared_experts`` (one SwiGLU of width n_shared * moe_intermediate)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__(hidden_size, moe, with_shared_expert=False)
        self.shared_experts = (
            MLP(hidden_size, moe.shared_expert_intermediate_size) if moe.shared_expert_intermediate_size > 0 else None
        )

    def shared_mlp(self) -> MLP | None:
        return self.shared_experts


class DecoderLayer(qwen3_moe.DecoderLayer):
    """Qwen3-MoE's pre-norm block with GLM's MoE (shared experts) and no o_proj bias; dense below
    ``first_k_dense_replace``."""

    moe_class = Glm4MoeMoE
    o_proj_bias = False


class Glm4MoeModel(qwen3_moe.Qwen3MoeModel):
    """Embedding, decoder layers, final norm; rotary embedding over ``partial_rotary_factor`` of each head."""

    layer_class = DecoderLayer


class Glm4MoeForCausalLM(qwen3_moe.Qwen3MoeForCausalLM):
    """Causal LM head over ``Glm4MoeModel``. ``self.config`` is the ``ModelConfig`` it was built from."""

    model_class = Glm4MoeModel


def check_glm4_moe_config(cfg: ModelConfig) -> list[str]:
    """What in ``cfg`` this family cannot build, as ``model.<key>=<value> (reason)`` strings (empty: fine).

    The rules live in ``nemo_ac.config.hf.glm4_moe`` (torch-free), so recipe validation rejects the same settings
    before any process group starts; here they guard direct ``build_model`` calls.
    """
    return [problem.describe() for problem in glm4_moe_problems(cfg)]


def build_glm4_moe(cfg: ModelConfig) -> Glm4MoeForCausalLM:
    """Builder registered for family ``glm4_moe``; rejects settings the family does not have (no silent fixes)."""
    bad = check_glm4_moe_config(cfg)
    if bad:
        raise ValueError(f"family glm4_moe: {', '.join(bad)}")
    return Glm4MoeForCausalLM(cfg)
