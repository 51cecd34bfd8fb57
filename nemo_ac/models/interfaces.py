"""Data that crosses the model boundary: what a forward takes besides token ids, and what it returns.

Per-micro-batch attention metadata travels as an argument (``AttentionInputs``), never through module globals,
so compiled blocks see it as graph inputs and the parallelizer can swap attention ops without reaching into the
data pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
    logits: torch.Tensor
    router_stats: list[RouterStats] = field(default_factory=list)


# Outputs are pytrees so that FSDP2 (which finds output tensors with tree_flatten to hook its pre-backward
# unshard) and torch.compile see the tensors inside them. Registering our own types changes no torch behaviour.
torch.utils._pytree.register_dataclass(RouterStats)
torch.utils._pytree.register_dataclass(ModelOutput)
