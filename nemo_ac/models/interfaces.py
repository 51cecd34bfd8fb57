"""What crosses the model boundary: the data a forward takes and returns, and the contract with the parallelizer.

Per-micro-batch attention metadata travels as an argument (``AttentionInputs``), never through module globals,
so compiled blocks see it as graph inputs and the parallelizer can swap attention ops without reaching into the
data pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn


@dataclass
class AttentionInputs:
    """Packed-document metadata for one micro batch, as seen by this rank.

    document_ids: [B, S] int32, index of the document each token belongs to within its row; attention is causal
        and confined to a document.
    cu_seqlens: [num_docs + 1] int32 cumulative document lengths over the flattened batch (for varlen kernels).
    max_seqlen: longest document in the micro batch (an int that changes every micro batch; declared dynamic
        for torch.compile, see ``nemo_ac.distributed.compile``).
    context_parallel: metadata a context-parallel attention op needs (ring/ulysses), set by the CP input sharder.
    """

    document_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    context_parallel: Any = None


@dataclass
class RouterStats:
    """Per-MoE-layer routing statistics for the load-balancing loss and aux-loss-free bias updates.

    tokens_per_expert: [E] float, detached, number of (token, slot) assignments per expert on this rank.
    prob_sum: [E] float with grad, sum over this rank's tokens of the router probability of each expert.
    num_tokens: tokens routed on this rank (an int).
    """

    tokens_per_expert: torch.Tensor
    prob_sum: torch.Tensor
    num_tokens: int


@dataclass
class ModelOutput:
    """A forward's result. Given ``labels``, a model returns ``ce_sum`` (the summed token cross entropy, from the LM
    head in token chunks) and no ``logits``; otherwise ``logits`` [B, S, V]."""

    logits: torch.Tensor | None = None
    router_stats: list[RouterStats] = field(default_factory=list)
    ce_sum: torch.Tensor | None = None


# Outputs are pytrees so that FSDP2 (which finds output tensors with tree_flatten to hook its pre-backward
# unshard) and torch.compile see the tensors inside them. Registering our own types changes no torch behaviour.
torch.utils._pytree.register_dataclass(RouterStats)
torch.utils._pytree.register_dataclass(ModelOutput)


# ------------------------------------------------------------------------------------------------------------
# The contract between a model family and the parallelizer (nemo_ac.distributed.plan / parallelize): what a model,
# its decoder blocks, their sequence mixers and their routed MoE expose. Every family implements it; the
# parallelizer probes no attribute names beyond these.


@runtime_checkable
class SequenceMixer(Protocol):
    """A module that mixes tokens along the sequence through one swappable op, the only part of a block that
    context parallel changes (``apply_cp`` replaces ``getattr(mixer, mixer_op_name)`` with its CP version).

    mixer_kind: ``softmax_attention`` (op ``attn_op``: ulysses or ring), ``linear_attention`` (Gated DeltaNet,
        ``linear_attn_op``) or ``ssm`` (Mamba-2, ``ssm_op``); the recurrent two take ulysses (head shards) or ring
        (state passing, ``context_parallel.state_passing``).
    """

    mixer_kind: ClassVar[str]
    mixer_op_name: ClassVar[str]


@runtime_checkable
class RoutedMoE(Protocol):
    """A routed Mixture-of-Experts layer: a router module, the routed expert weights and a swappable dispatcher.

    router_module: the router weights (its own fp32 FSDP unit with ``moe.router_dtype: float32``).
    experts_module: the routed experts' weights [E, ...] (sharded over EP on dim 0; its own FSDP unit with
        ``moe.separate_fsdp_unit``).
    set_dispatcher: replace the local dispatcher with an expert-parallel one (``dispatch`` / ``combine``).
    """

    def router_module(self) -> nn.Module: ...

    def experts_module(self) -> nn.Module: ...

    def set_dispatcher(self, dispatcher: Any) -> None: ...


@runtime_checkable
class DecoderBlock(Protocol):
    """One decoder block: its routed MoE (None for dense blocks); its mixers are found as ``SequenceMixer``
    submodules."""

    def routed_moe(self) -> RoutedMoE | None: ...


@runtime_checkable
class ParallelizableModel(Protocol):
    """A causal LM the parallelizer can take: its decoder block list (and where it sits, for region names in
    errors and the printed plan), and its vision tower's blocks (None for text-only models)."""

    decoder_blocks_path: ClassVar[str]

    def decoder_blocks(self) -> nn.ModuleList: ...

    def vision_blocks(self) -> nn.ModuleList | None: ...
