"""Ulysses (DeepSpeed-style) context parallel: all-to-all from sequence shards to head shards around a sequence mixer.

Each rank holds ``S/cp`` contiguous tokens of every head. One all-to-all per dtype (inputs packed into one tensor, so
one collective each way and a fixed backward order) gives each rank the full sequence for ``1/cp`` of the heads;
the mixer's own local op runs unchanged on it with the full rows' document ids; a second all-to-all brings the
output back to sequence shards. Three mixers expose such an op, so the same two helpers wrap all of them:

- softmax attention ``attn_op(q, k, v, attn)``: rank ``r`` takes query heads ``[r*nh/cp, (r+1)*nh/cp)`` and, with
  ``nkv % cp == 0``, kv heads ``[r*nkv/cp, ...)`` (exactly those its query heads use). With ``nkv < cp``
  (``cp % nkv == 0``) each kv head is repeated ``cp/nkv`` times first, so rank ``r`` receives kv head ``r*nkv/cp``,
  the one all its query heads use; the repeat's backward sums the copies' gradients.
- Gated DeltaNet ``linear_attn_op(q, k, v, g, beta, conv_weights, attn)`` (Qwen3.5/3.6): key heads and value heads
  split alike (value head ``i`` reads key head ``i // (Hv/Hk)``, so needs ``Hk % cp == 0``); the depthwise conv
  kernel is sliced to the local heads, and FSDP sums the other ranks' slices' gradients.
- Mamba-2 ``ssm_op(x, B, C, dt, params, attn)`` (Nemotron-H): heads split; B/C groups split alike when
  ``G % cp == 0`` and are repeated like kv heads when ``G < cp``; ``params.select`` cuts the local heads/groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from nemo_ac.distributed.context_parallel.sharding import UlyssesAttentionInputs
from nemo_ac.models.interfaces import AttentionInputs


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup | str) -> torch.Tensor:
    """Equal-split differentiable all-to-all over dim 0 (chunk ``j`` goes to rank ``j``)."""
    return funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)


def seq_to_heads(
    tensors: Sequence[torch.Tensor], *, group: dist.ProcessGroup | str, cp_size: int
) -> list[torch.Tensor]:
    """Each [B, s, H_i, *rest] (sequence shard, all heads) -> [B, cp*s, H_i/cp, *rest] (full sequence, this rank's
    heads). Tensors of one dtype travel in one all-to-all."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for indices in by_dtype.values():
        parts, widths = [], []
        for i in indices:
            b, s, h = tensors[i].shape[:3]
            width = (h // cp_size) * math.prod(tensors[i].shape[3:])
            parts.append(tensors[i].reshape(b, s, cp_size, width).permute(2, 0, 1, 3))  # [cp, B, s, F_i]
            widths.append(width)
        packed = torch.cat(parts, dim=3)
        cp, b, s, feat = packed.shape
        received = _all_to_all(packed.reshape(cp * b, s, feat), group)
        # [cp(source = sequence shard), B, s, F] -> [B, S, F]: shards in rank order are the sequence in order.
        full = received.view(cp, b, s, feat).permute(1, 0, 2, 3).reshape(b, cp * s, feat)
        for i, piece in zip(indices, full.split(widths, dim=2)):
            h, rest = tensors[i].shape[2], tensors[i].shape[3:]
            out[i] = piece.reshape(b, cp * s, h // cp_size, *rest)
    return out  # type: ignore[return-value]


def heads_to_seq(x: torch.Tensor, *, group: dist.ProcessGroup | str, cp_size: int) -> torch.Tensor:
    """[B, S, H/cp, *rest] (full sequence, this rank's heads) -> [B, S/cp, H, *rest] (sequence shard, all heads)."""
    b, full_len, h_local = x.shape[:3]
    rest = x.shape[3:]
    s = full_len // cp_size
    width = h_local * math.prod(rest)
    by_shard = x.reshape(b, cp_size, s, width).transpose(0, 1).reshape(cp_size * b, s, width)
    returned = _all_to_all(by_shard, group)  # [cp(source = head group), B, s, F]
    return returned.view(cp_size, b, s, width).permute(1, 2, 0, 3).reshape(b, s, h_local * cp_size, *rest)


def _full_inputs(attn: AttentionInputs, kind: str) -> AttentionInputs:
    meta = attn.context_parallel
    if not isinstance(meta, UlyssesAttentionInputs):
        raise TypeError(
            f"ulysses context-parallel {kind} needs UlyssesAttentionInputs in attn.context_parallel (the trainer's "
            f"CP batch preparer builds it for parallel.cp_type: ulysses); got {type(meta).__name__}"
        )
    return AttentionInputs(document_ids=meta.document_ids, cu_seqlens=meta.cu_seqlens, max_seqlen=meta.max_seqlen)


def _repeat_to(x: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Heads (dim 2) fewer than cp: repeat each ``cp / H`` times so every rank receives the one it needs."""
    return x if x.shape[2] % cp_size == 0 else x.repeat_interleave(cp_size // x.shape[2], dim=2)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn: AttentionInputs,
    *,
    inner: Callable,
    group: dist.ProcessGroup | str,
    cp_size: int,
) -> torch.Tensor:
    """``Attention.attn_op`` for ``cp_type: ulysses``: q [B, s, nh, d], k/v [B, s, nkv, d] -> [B, s, nh, d] on this
    rank's contiguous shard ``s = S/cp``; ``inner`` is the local op, run on [B, S, nh/cp, d]."""
    full_inputs = _full_inputs(attn, "attention")
    q_h, k_h, v_h = seq_to_heads((q, _repeat_to(k, cp_size), _repeat_to(v, cp_size)), group=group, cp_size=cp_size)
    return heads_to_seq(inner(q_h, k_h, v_h, full_inputs), group=group, cp_size=cp_size)


def ulysses_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    attn: AttentionInputs,
    *,
    inner: Callable,
    group: dist.ProcessGroup | str,
    cp_size: int,
    cp_rank: int,
) -> torch.Tensor:
    """``GatedDeltaNet.linear_attn_op`` for ``cp_type: ulysses`` (signature in nemo_ac.models.layers.gated_deltanet)."""
    full_inputs = _full_inputs(attn, "linear attention")
    q_h, k_h, v_h, g_h, beta_h = seq_to_heads((q, k, v, g, beta), group=group, cp_size=cp_size)
    wq, wk, wv = conv_weights
    hk, hv = wq.shape[0] // cp_size, wv.shape[0] // cp_size
    local_weights = (
        wq[cp_rank * hk : (cp_rank + 1) * hk],
        wk[cp_rank * hk : (cp_rank + 1) * hk],
        wv[cp_rank * hv : (cp_rank + 1) * hv],
    )
    out = inner(q_h, k_h, v_h, g_h, beta_h, local_weights, full_inputs)
    return heads_to_seq(out, group=group, cp_size=cp_size)


def ulysses_ssm(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    params,
    attn: AttentionInputs,
    *,
    inner: Callable,
    group: dist.ProcessGroup | str,
    cp_size: int,
    cp_rank: int,
) -> torch.Tensor:
    """``Mamba2Mixer.ssm_op`` for ``cp_type: ulysses`` (signature in nemo_ac.models.layers.mamba2)."""
    full_inputs = _full_inputs(attn, "Mamba-2 scan")
    num_heads, num_groups = x.shape[2], B.shape[2]
    x_h, b_h, c_h, dt_h = seq_to_heads(
        (x, _repeat_to(B, cp_size), _repeat_to(C, cp_size), dt), group=group, cp_size=cp_size
    )
    heads = slice(cp_rank * num_heads // cp_size, (cp_rank + 1) * num_heads // cp_size)
    if num_groups % cp_size == 0:
        groups = slice(cp_rank * num_groups // cp_size, (cp_rank + 1) * num_groups // cp_size)
    else:  # replicated: this rank received one copy of group r // (cp / G)
        first = cp_rank // (cp_size // num_groups)
        groups = slice(first, first + 1)
    out = inner(x_h, b_h, c_h, dt_h, params.select(heads, groups), full_inputs)
    return heads_to_seq(out, group=group, cp_size=cp_size)
