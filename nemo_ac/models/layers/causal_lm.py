"""The causal LM every family is: a ``DecoderStack`` (token embedding, decoder layers, final norm, rotary
embedding) under ``model`` and an ``lm_head``, with the parallelizer's contract (``interfaces.ParallelizableModel``).

Families differ in their layers, norms, positional encoding and in transformers' names for the embedding and the
final norm (``embed_tokens`` / ``norm``; Nemotron-H: ``embeddings`` / ``norm_f``); those names are the state-dict
keys HF checkpoints, ``nemo_ac.trainer.checkpoint.hf_safetensors`` and DCP checkpoints use, and ``nemo_ac.models.init``
seeds each tensor from its name, so a family passes them rather than this module choosing one spelling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models.interfaces import AttentionInputs, ModelOutput, RouterStats
from nemo_ac.models.kernels.chunked_cross_entropy import chunked_cross_entropy_sum
from nemo_ac.models.layers.decoder_layer import NormClass


class DecoderStack(nn.Module):
    """Token embedding, decoder layers, final norm; ``rotary`` (None: no positional encoding) turns position ids
    into the ``(cos, sin)`` every layer gets, computed once per forward.

    Every layer follows ``forward(hidden, *, rope, attn) -> (hidden, RouterStats | None)``; the router stats of the
    MoE layers are returned in layer order for the load-balancing loss and the expert-bias update.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        layers: Iterable[nn.Module],
        norm_class: NormClass,
        rotary: nn.Module | None,
        embedding_name: str = "embed_tokens",
        final_norm_name: str = "norm",
    ) -> None:
        super().__init__()
        self.embedding_name = embedding_name
        self.final_norm_name = final_norm_name
        self.add_module(embedding_name, nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.add_module(final_norm_name, norm_class(cfg.hidden_size, cfg.rms_norm_eps))
        self.rotary_emb = rotary

    def embedding(self) -> nn.Embedding:
        return getattr(self, self.embedding_name)

    def final_norm(self) -> nn.Module:
        return getattr(self, self.final_norm_name)

    def decode(
        self, hidden: torch.Tensor, *, position_ids: torch.Tensor, attn: AttentionInputs
    ) -> tuple[torch.Tensor, list[RouterStats]]:
        """Decoder layers and final norm over embeddings [B, S, H]; position_ids as ``rotary`` takes them."""
        rope = self.rotary_emb(position_ids, dtype=hidden.dtype) if self.rotary_emb is not None else None
        router_stats: list[RouterStats] = []
        for layer in self.layers:
            hidden, stats = layer(hidden, rope=rope, attn=attn)
            if stats is not None:
                router_stats.append(stats)
        return self.final_norm()(hidden), router_stats

    def forward(
        self, input_ids: torch.Tensor, *, position_ids: torch.Tensor, attn: AttentionInputs
    ) -> tuple[torch.Tensor, list[RouterStats]]:
        return self.decode(self.embedding()(input_ids), position_ids=position_ids, attn=attn)


class CausalLM(nn.Module):
    """``model`` (built by the family's ``model_class``) and ``lm_head``, tied to the embedding with
    ``tie_word_embeddings``. ``self.config`` is the ``ModelConfig`` it was built from.

    A family sets ``model_class`` and ``decoder_blocks_path`` and, when its ``DecoderStack`` is not ``model``
    itself (Qwen3.5's ``model.language_model``), overrides ``decoder``.
    """

    model_class: ClassVar[Callable[[ModelConfig], nn.Module]]
    decoder_blocks_path: ClassVar[str] = "model.layers"  # interfaces.ParallelizableModel

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.tie_weights()

    def decoder(self) -> DecoderStack:
        """The text decoder (embedding, layers, final norm)."""
        return self.model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.decoder().embedding()

    def decoder_blocks(self) -> nn.ModuleList:
        return self.decoder().layers

    def vision_blocks(self) -> nn.ModuleList | None:
        return None

    def tie_weights(self) -> None:
        """Share the embedding with the output projection (call again after ``to_empty``)."""
        self.lm_head.weight = self.get_input_embeddings().weight

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        attn: AttentionInputs,
        labels: torch.Tensor | None = None,
        loss_chunk_tokens: int = 0,
    ) -> ModelOutput:
        hidden, router_stats = self.model(input_ids, position_ids=position_ids, attn=attn)
        return self.head_output(hidden, router_stats, labels=labels, loss_chunk_tokens=loss_chunk_tokens)

    def head_output(
        self,
        hidden: torch.Tensor,
        router_stats: list[RouterStats],
        *,
        labels: torch.Tensor | None,
        loss_chunk_tokens: int,
    ) -> ModelOutput:
        """Logits, or with ``labels`` the summed cross entropy over ``loss_chunk_tokens``-token chunks (no logits
        tensor). It runs inside the forward so that the LM head's weight is the gathered one (FSDP2 unshards the
        root unit for its forward and keeps it through backward)."""
        if labels is None:
            return ModelOutput(logits=self.lm_head(hidden), router_stats=router_stats)
        ce_sum = chunked_cross_entropy_sum(hidden, self.lm_head.weight, labels, chunk_tokens=loss_chunk_tokens)
        return ModelOutput(ce_sum=ce_sum, router_stats=router_stats)
