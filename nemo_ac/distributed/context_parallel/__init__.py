"""Context parallel: the sequence of every micro batch is split over the ``cp`` ranks.

``apply_cp`` swaps each sequence mixer's op (softmax attention ``attn_op``; for Ulysses also Gated DeltaNet's
``linear_attn_op`` and Mamba-2's ``ssm_op``) for its CP version bound to the CP process group; everything else in a
block (projections, norms, rope, MLP / MoE) is per token and runs on the shard unchanged. The
trainer's batch preparer (``nemo_ac.trainer.batching``) shards tokens, labels, positions and document ids with
``sharding.shard_positions`` and attaches the op's per-micro-batch metadata to ``AttentionInputs.context_parallel``.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nemo_ac.distributed.blocks import decoder_layers, unwrap_block
from nemo_ac.distributed.context_parallel.ring import ring_attention
from nemo_ac.distributed.context_parallel.sharding import (
    RingAttentionInputs,
    UlyssesAttentionInputs,
    ring_attention_inputs,
    shard_positions,
    shard_sequence,
    ulysses_attention_inputs,
)
from nemo_ac.distributed.context_parallel.ulysses import ulysses_attention, ulysses_linear_attention, ulysses_ssm

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


# Swappable sequence-mixing ops of the model's mixers (attribute name -> what it is, for error messages).
_MIXER_OPS = {"attn_op": "softmax attention", "linear_attn_op": "linear attention", "ssm_op": "Mamba-2 scan"}


def _mixers(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, op attribute) of every sequence mixer in ``block``: what must see more than its own tokens."""
    return [(m, attr) for m in unwrap_block(block).modules() for attr in _MIXER_OPS if hasattr(m, attr)]


def _cp_op(module: nn.Module, attr: str, *, cp_type: str, group, rank: int, size: int, index: int):
    inner = getattr(module, attr)
    if cp_type == "ring":
        if attr != "attn_op":
            raise ValueError(
                f"parallel.cp_type: ring passes softmax-attention K/V blocks; layer {index} has a "
                f"{_MIXER_OPS[attr]} mixer whose recurrent state cannot be ring-passed. Use cp_type: ulysses"
            )
        return functools.partial(ring_attention, group=group, cp_rank=rank, cp_size=size)
    if cp_type != "ulysses":
        raise ValueError(f"parallel.cp_type: unknown {cp_type!r}; use ulysses or ring")
    if attr == "attn_op":
        return functools.partial(ulysses_attention, inner=inner, group=group, cp_size=size)
    wrapper = ulysses_linear_attention if attr == "linear_attn_op" else ulysses_ssm
    return functools.partial(wrapper, inner=inner, group=group, cp_size=size, cp_rank=rank)


def apply_cp(model: nn.Module, *, cp_mesh: DeviceMesh | None, cp_type: str) -> None:
    """Swap every sequence mixer's op for its CP version (``cp_mesh`` None: cp == 1, nothing to do).

    Ulysses wraps the mixer's current op (any local op works on a head shard): softmax attention, Gated DeltaNet
    linear attention and the Mamba-2 scan. Ring replaces softmax attention (it needs each block's log-sum-exp)
    and cannot take recurrent mixers. Per-token layers (projections, norms, MLP / MoE) need nothing.
    """
    if cp_mesh is None:
        return
    group, rank, size = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
    for index, block in enumerate(decoder_layers(model)):
        for module, attr in _mixers(block):
            setattr(module, attr, _cp_op(module, attr, cp_type=cp_type, group=group, rank=rank, size=size, index=index))
