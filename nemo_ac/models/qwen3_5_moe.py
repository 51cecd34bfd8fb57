"""Qwen3.5 / Qwen3.6 MoE vision-language model (family ``qwen3_5_moe``; Qwen3.6-35B-A3B uses this architecture).

``state_dict()`` keys equal transformers 5's ``Qwen3_5MoeForConditionalGeneration``: ``model.visual.*`` (vision
tower, absent when ``vision.depth == 0``), ``model.language_model.{embed_tokens, layers.N.*, norm}`` and ``lm_head``.
Decoder layers are hybrid (``layer_pattern``: L = Gated DeltaNet at ``layers.N.linear_attn``, A = gated softmax
attention at ``layers.N.self_attn``); every layer has an MoE at ``layers.N.mlp`` (router ``gate``, ``experts``,
``dispatcher``, sigmoid-gated ``shared_expert``). Norms are zero-centered (``x * (1 + weight)``, weight init 0).

The decoder block list is ``model.model.language_model.layers`` (HF's VL nesting). Each layer is a
``common.decoder_layer.PreNormDecoderLayer`` (``forward(hidden, *, rope, attn) -> (hidden, RouterStats | None)``,
``is_moe``) whose mixer is chosen per layer; linear-attention layers ignore ``rope``. The text decoder and the LM
head are ``common.causal_lm``'s ``DecoderStack`` and ``CausalLM``.

Two entry points, so vision runs on the full sequence before context-parallel sharding:

- ``embed_inputs(input_ids, *, position_ids, document_ids, pixel_values, image_grid_thw) -> MultimodalEmbeddings``
  computes token embeddings with the vision features scattered into the image placeholder tokens and the [3, B, S]
  M-RoPE positions. Both are per-token tensors (sequence dim 1 of ``inputs_embeds``, last dim of ``position_ids``)
  that a CP sharder splits like ``input_ids``. Under FSDP2 the trainer registers it with
  ``torch.distributed.fsdp.register_fsdp_forward_method(model, "embed_inputs")`` so the root unit unshards for it.
- ``forward(input_ids, *, position_ids, attn, pixel_values=None, image_grid_thw=None, inputs_embeds=None)`` runs
  both steps when ``inputs_embeds`` is None, or only the decoder on given (possibly CP-sharded) embeddings and
  positions (then ``input_ids``, ``pixel_values`` and ``image_grid_thw`` are ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models.interfaces import AttentionInputs, ModelOutput, RouterStats
from nemo_ac.models.layers.causal_lm import CausalLM, DecoderStack
from nemo_ac.models.layers.decoder_layer import PreNormDecoderLayer, attention_from_config
from nemo_ac.models.layers.gated_deltanet import GatedDeltaNet
from nemo_ac.models.layers.mrope import MRotaryEmbedding, multimodal_position_ids
from nemo_ac.models.layers.vision import VisionModel

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
_PATTERN_CHARS = {"L": LINEAR_ATTENTION, "A": FULL_ATTENTION}
# transformers' default when a config has no layer_types: every full_attention_interval-th layer is full attention.
DEFAULT_FULL_ATTENTION_INTERVAL = 4


def layer_types(cfg: ModelConfig) -> list[str]:
    """``layer_pattern`` ("LLLA...") as HF layer types; empty = HF's default interval of 4."""
    if not cfg.layer_pattern:
        return [
            FULL_ATTENTION if (i + 1) % DEFAULT_FULL_ATTENTION_INTERVAL == 0 else LINEAR_ATTENTION
            for i in range(cfg.num_layers)
        ]
    bad = sorted(set(cfg.layer_pattern) - set(_PATTERN_CHARS))
    if bad or len(cfg.layer_pattern) != cfg.num_layers:
        raise ValueError(
            f"model.layer_pattern={cfg.layer_pattern!r} must have num_layers={cfg.num_layers} characters from "
            f"{sorted(_PATTERN_CHARS)} (L = linear attention, A = full attention)"
        )
    return [_PATTERN_CHARS[c] for c in cfg.layer_pattern]


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5 RMSNorm: ``(norm(x) * (1 + weight))`` in fp32, then cast to x's dtype; weight initialized to zero.

    (Qwen3's ``RMSNorm`` casts before multiplying by the weight; here the scale is applied in fp32, as in
    transformers' ``Qwen3_5MoeRMSNorm``.)
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def initial_parameter(self, name: str, generator: torch.Generator) -> torch.Tensor | None:
        """Init hook of ``nemo_ac.models.init``: zero, i.e. a unit scale."""
        return torch.zeros(self.weight.shape) if name == "weight" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.to(torch.float32))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class Qwen3_5MoeDecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: ``h + mixer(norm(h))`` (Gated DeltaNet or gated attention), then ``h + moe(norm(h))``."""

    norm_class = ZeroCenteredRMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int, layer_type: str) -> None:
        mixer: nn.Module
        if layer_type == LINEAR_ATTENTION:
            name = "linear_attn"
            mixer = GatedDeltaNet(cfg.hidden_size, cfg.linear_attention, rms_norm_eps=cfg.rms_norm_eps)
        else:
            name, mixer = "self_attn", attention_from_config(cfg, norm_class=self.norm_class)
        super().__init__(cfg, layer_idx, mixer_name=name, mixer=mixer)
        self.layer_type = layer_type

    def mix(
        self, x: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor] | None, attn: AttentionInputs
    ) -> torch.Tensor:
        """Gated DeltaNet (no rope: its recurrence orders the tokens) or gated softmax attention."""
        if self.layer_type == LINEAR_ATTENTION:
            return self.linear_attn(x, attn=attn)
        return self.self_attn(x, rope=rope, attn=attn)


class Qwen3_5MoeTextModel(DecoderStack):
    """Embedding table, hybrid decoder layers, final norm; ``forward`` starts from embeddings."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(
            cfg,
            layers=(Qwen3_5MoeDecoderLayer(cfg, i, kind) for i, kind in enumerate(layer_types(cfg))),
            norm_class=ZeroCenteredRMSNorm,
            rotary=MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.partial_rotary_factor, cfg.mrope_section),
        )

    def forward(  # embeddings, not ids (as transformers): the vision tower fills image placeholders first
        self, inputs_embeds: torch.Tensor, *, position_ids: torch.Tensor, attn: AttentionInputs
    ) -> tuple[torch.Tensor, list[RouterStats]]:
        return self.decode(inputs_embeds, position_ids=position_ids, attn=attn)


@dataclass
class MultimodalEmbeddings:
    """Decoder inputs for the full sequence. inputs_embeds: [B, S, H]; position_ids: [3, B, S] (t, h, w)."""

    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor


# A pytree so FSDP2 (registered forward method) and torch.compile see the tensors inside.
torch.utils._pytree.register_dataclass(MultimodalEmbeddings)


class Qwen3_5MoeModel(nn.Module):
    """``visual`` (None without a vision tower) + ``language_model``, as in transformers."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.visual = VisionModel(cfg.vision, cfg.hidden_size) if cfg.vision.depth > 0 else None
        self.language_model = Qwen3_5MoeTextModel(cfg)


class Qwen3_5MoeForConditionalGeneration(CausalLM):
    """Causal LM head over ``Qwen3_5MoeModel``. ``self.config`` is the ``ModelConfig`` it was built from."""

    model_class = Qwen3_5MoeModel
    decoder_blocks_path = "model.language_model.layers"  # interfaces.ParallelizableModel

    def decoder(self) -> Qwen3_5MoeTextModel:
        return self.model.language_model

    def vision_blocks(self) -> nn.ModuleList | None:
        return self.model.visual.blocks if self.model.visual is not None else None

    def embed_inputs(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> MultimodalEmbeddings:
        """Full-sequence decoder inputs: embeddings with image features in the placeholders + M-RoPE positions.

        input_ids / position_ids / document_ids: [B, S] (positions restart per packed document, document_ids keep
        an image's position shift inside its document; None = one document per row). pixel_values / image_grid_thw:
        all images of the micro batch in row-major placeholder order (see ``nemo_ac.models.layers.vision``).
        """
        return self._embed(input_ids, position_ids, document_ids, pixel_values, image_grid_thw)

    def _embed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor | None,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
    ) -> MultimodalEmbeddings:
        embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is None:
            return MultimodalEmbeddings(embeds, position_ids.unsqueeze(0).expand(3, -1, -1))
        visual = self.model.visual
        if visual is None:
            raise ValueError("pixel_values given but the model has no vision tower (model.vision.depth == 0)")
        if image_grid_thw is None:
            raise ValueError("pixel_values need image_grid_thw ([num_images, 3] patch grids)")
        vision = self.config.vision
        features = visual(pixel_values, image_grid_thw).to(embeds.dtype)
        mask = input_ids == vision.image_token_id
        num_placeholders = int(mask.sum())
        if num_placeholders != features.shape[0]:
            raise ValueError(
                f"{num_placeholders} image placeholder tokens (id {vision.image_token_id}) but the vision tower made "
                f"{features.shape[0]} image features"
            )
        embeds = embeds.masked_scatter(mask.unsqueeze(-1), features)
        positions = multimodal_position_ids(
            input_ids,
            position_ids,
            image_grid_thw=image_grid_thw,
            image_token_id=vision.image_token_id,
            spatial_merge_size=vision.spatial_merge_size,
            document_ids=document_ids,
        )
        return MultimodalEmbeddings(embeds, positions)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor,
        attn: AttentionInputs,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_chunk_tokens: int = 0,
    ) -> ModelOutput:
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            embedded = self._embed(input_ids, position_ids, attn.document_ids, pixel_values, image_grid_thw)
            inputs_embeds, position_ids = embedded.inputs_embeds, embedded.position_ids
        hidden, router_stats = self.decoder()(inputs_embeds, position_ids=position_ids, attn=attn)
        return self.head_output(hidden, router_stats, labels=labels, loss_chunk_tokens=loss_chunk_tokens)


def build_qwen3_5_moe(cfg: ModelConfig) -> Qwen3_5MoeForConditionalGeneration:
    """Builder registered for family ``qwen3_5_moe``; rejects options that belong to other families."""
    if cfg.moe.latent_size:
        raise NotImplementedError(f"family qwen3_5_moe does not support model.moe.latent_size={cfg.moe.latent_size}")
    layer_types(cfg)  # validates layer_pattern
    rotary_half = int(cfg.head_dim * cfg.partial_rotary_factor) // 2
    if cfg.mrope_section and sum(cfg.mrope_section) != rotary_half:
        raise ValueError(
            f"model.mrope_section={cfg.mrope_section} must sum to rotary_dim/2 = {rotary_half} "
            f"(head_dim {cfg.head_dim} * partial_rotary_factor {cfg.partial_rotary_factor} / 2)"
        )
    if cfg.vision.depth > 0 and not cfg.mrope_section:
        raise ValueError("model.mrope_section is required with a vision tower (e.g. [11, 11, 10] for Qwen3.6)")
    return Qwen3_5MoeForConditionalGeneration(cfg)
