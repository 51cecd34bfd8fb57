"""Context parallel: the sequence of every micro batch is split over the ``cp`` ranks.

``apply_cp`` swaps each sequence mixer's op (``models.interfaces.SequenceMixer``: softmax attention ``attn_op``,
Gated DeltaNet's ``linear_attn_op`` and Mamba-2's ``ssm_op``) for its CP version bound to the CP process group
(ulysses: ``ulysses``; ring: the K/V ring ``ring`` for softmax attention, state passing ``state_passing`` for the
recurrent mixers); everything else in a block (projections, norms, rope, MLP / MoE) is per token and runs on the shard unchanged. The
trainer's batch preparer (``nemo_ac.trainer.batching``) shards tokens, labels, positions and document ids with
``sharding.shard_positions`` and attaches the op's per-micro-batch metadata to ``AttentionInputs.context_parallel``.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nemo_ac.distributed.blocks import decoder_layers, sequence_mixers
from nemo_ac.distributed.context_parallel.ring import ring_attention
from nemo_ac.distributed.context_parallel.sharding import (
    RingAttentionInputs,
    UlyssesAttentionInputs,
    ring_attention_inputs,
    shard_positions,
    shard_sequence,
    ulysses_attention_inputs,
)
from nemo_ac.distributed.context_parallel.state_passing import ring_linear_attention, ring_ssm
from nemo_ac.distributed.context_parallel.ulysses import ulysses_attention, ulysses_linear_attention, ulysses_ssm
from nemo_ac.distributed.plan import ParallelPlan
from nemo_ac.models.interfaces import SequenceMixer
from nemo_ac.workarounds.shared_group_names import shared_group_name

__all__ = [
    "RingAttentionInputs",
    "UlyssesAttentionInputs",
    "apply_cp",
    "ring_attention",
    "ring_attention_inputs",
    "shard_positions",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_attention_inputs",
]


def _cp_op(mixer: SequenceMixer, *, cp_type: str, group, rank: int, size: int, attention_kernel: str):
    inner = getattr(mixer, mixer.mixer_op_name)
    if cp_type == "ring":
        ring = {"softmax_attention": ring_attention, "linear_attention": ring_linear_attention, "ssm": ring_ssm}
        extra = {"kernel": attention_kernel} if mixer.mixer_kind == "softmax_attention" else {}
        if mixer.mixer_kind == "linear_attention":
            extra = {"chunk_size": mixer.chunk_size}
        return functools.partial(ring[mixer.mixer_kind], group=group, cp_rank=rank, cp_size=size, **extra)
    if mixer.mixer_kind == "softmax_attention":
        return functools.partial(ulysses_attention, inner=inner, group=group, cp_size=size)
    wrapper = ulysses_linear_attention if mixer.mixer_kind == "linear_attention" else ulysses_ssm
    return functools.partial(wrapper, inner=inner, group=group, cp_size=size, cp_rank=rank)


def apply_cp(model: nn.Module, *, plan: ParallelPlan, cp_mesh: DeviceMesh | None) -> None:
    """Swap every sequence mixer's op for its CP version (``cp_mesh`` None: cp == 1, nothing to do).

    Ulysses wraps the mixer's current op (any local op works on a head shard): softmax attention, Gated DeltaNet
    linear attention and the Mamba-2 scan. Ring replaces the op: softmax attention by the K/V ring (it needs each
    block's log-sum-exp), Gated DeltaNet and Mamba-2 by their state-passing torch ops (each slice runs from a zero
    state; the carried states are exchanged and added). Per-token layers (projections, norms, MLP / MoE) need
    nothing.
    """
    if cp_mesh is None:
        return
    group, rank, size = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
    if plan.collectives_by_mesh_dim():
        # One name for this rank's CP group on every rank: compiled graphs equal across CP groups share one compile
        # per node (workarounds.shared_group_names); the ops only hand the group to functional collectives.
        group = shared_group_name(group, role="cp")
    for block in decoder_layers(model):
        for mixer in sequence_mixers(block):
            op = _cp_op(
                mixer,
                cp_type=plan.cp_type,
                group=group,
                rank=rank,
                size=size,
                attention_kernel=plan.kernels.attention.value,
            )
            setattr(mixer, mixer.mixer_op_name, op)
