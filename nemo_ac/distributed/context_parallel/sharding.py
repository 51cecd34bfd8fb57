"""Which sequence positions each context-parallel rank holds, and the per-micro-batch metadata CP attention needs.

Every CP rank receives the same full rows from the data pipeline (CP ranks share data), so everything here is
computed locally from the full ``document_ids``; no communication.

- ulysses: contiguous shards, rank ``r`` holds ``[r*S/cp, (r+1)*S/cp)``. After the sequence<->heads all-to-all each
  rank sees the full sequence for its heads, so the work is balanced whatever the mask.
- ring: head-tail (zigzag) shards: the sequence is cut into ``2*cp`` chunks and rank ``r`` holds chunks ``r`` and
  ``2*cp-1-r``. With a causal mask a rank's early chunk needs few keys and its late chunk many, so every rank does
  the same causal work (contiguous shards would leave rank 0 nearly idle and the last rank with most of it).

The ring metadata's ints change every micro batch; they are what a varlen kernel takes as launch bounds and what
``compile`` declares dynamic (fields ``max_seqlen_q``, ``max_seqlen_k``, ``local_k_slice``). The torch ring op uses
them to bound its mask, so they are real inputs of the computation (a stale value changes the result).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_ac.models.layers.attention import build_attention_inputs

CP_TYPES = ("ulysses", "ring")


def chunks_per_rank(cp_type: str) -> int:
    if cp_type not in CP_TYPES:
        raise ValueError(f"parallel.cp_type: unknown {cp_type!r}; use one of {list(CP_TYPES)}")
    return 2 if cp_type == "ring" else 1


def check_shardable(seq_len: int, *, cp_size: int, cp_type: str) -> None:
    divisor = cp_size * chunks_per_rank(cp_type)
    if seq_len % divisor:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {divisor} ({cp_type} CP over {cp_size} ranks); "
            "pad rows to a multiple of it (data.seq_len / data.pad_multiple)"
        )


def head_tail_positions(chunk: int, *, cp_size: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions [2*chunk] of ring rank ``cp_rank``: chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``."""
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        (
            torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
            torch.arange(late * chunk, (late + 1) * chunk, device=device),
        )
    )


def shard_positions(
    seq_len: int, *, cp_size: int, cp_rank: int, cp_type: str, device: torch.device | None = None
) -> torch.Tensor:
    """Global positions this rank holds, in local order (ulysses: contiguous; ring: head-tail)."""
    check_shardable(seq_len, cp_size=cp_size, cp_type=cp_type)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    if cp_type == "ring":
        return head_tail_positions(seq_len // (2 * cp_size), cp_size=cp_size, cp_rank=cp_rank, device=device)
    local = seq_len // cp_size
    return torch.arange(cp_rank * local, (cp_rank + 1) * local, device=device)


def shard_sequence(tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, S, ...] -> [B, len(positions), ...]: this rank's tokens, labels, positions or document ids."""
    return tensor.index_select(1, positions.to(tensor.device))


def document_extents(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of [B, S] rows: ``(start, length)`` of its document (a maximal run of one id; each padding
    token, id -1, is a document of its own)."""
    b, s = document_ids.shape
    idx = torch.arange(s, device=document_ids.device).expand(b, s)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]) | (document_ids[:, 1:] < 0)
    start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    end = torch.where(ends, idx, torch.full_like(idx, s)).flip(1).cummin(dim=1).values.flip(1)
    return start, end - start + 1


@dataclass
class UlyssesAttentionInputs:
    """What the Ulysses op needs besides the rank's shard: the full rows' document ids (after the all-to-all each
    rank attends over the whole sequence for its heads)."""

    document_ids: torch.Tensor  # [B, S] int32, full rows
    cu_seqlens: torch.Tensor  # [num_docs + 1] int32 over the full flattened batch
    max_seqlen: int  # longest document of the micro batch


@dataclass
class RingAttentionInputs:
    """What the ring op needs besides the rank's shard (ints in flash-attn varlen terms).

    document_ids: [B, S] int32 full rows; the ring slices the document ids of each K/V block it receives from
        these (no need to send them around the ring: every CP rank has the full rows).
    max_seqlen_q: longest document that has a query on this rank. No local query attends a key further back.
    max_seqlen_k: longest document of the micro batch (keys of every rank pass by). No query attends further back.
    local_k_slice: first global key position any local query can attend (start of the document holding this
        rank's first position); keys before it are never attended by this rank (flash-attn's ``local_k_slice``
        start; its stop is the causal limit).
    """

    document_ids: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    local_k_slice: int


def ulysses_attention_inputs(document_ids: torch.Tensor) -> UlyssesAttentionInputs:
    full = build_attention_inputs(document_ids)
    return UlyssesAttentionInputs(
        document_ids=full.document_ids, cu_seqlens=full.cu_seqlens, max_seqlen=full.max_seqlen
    )


def ring_attention_inputs(document_ids: torch.Tensor, *, cp_size: int, cp_rank: int) -> RingAttentionInputs:
    """The ring metadata of rank ``cp_rank`` for full rows ``document_ids`` [B, S] (one host sync for the ints)."""
    s = document_ids.shape[1]
    check_shardable(s, cp_size=cp_size, cp_type="ring")
    start, length = document_extents(document_ids)
    local = head_tail_positions(s // (2 * cp_size), cp_size=cp_size, cp_rank=cp_rank, device=document_ids.device)
    ints = torch.stack((length.index_select(1, local).max(), length.max(), start.index_select(1, local).min())).tolist()
    return RingAttentionInputs(
        document_ids=document_ids.to(torch.int32),
        max_seqlen_q=int(ints[0]),
        max_seqlen_k=int(ints[1]),
        local_k_slice=int(ints[2]),
    )
