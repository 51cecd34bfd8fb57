"""Ring attention over head-tail sharded sequences: K/V blocks travel around the CP ring, partial results are
merged with the online-softmax (log-sum-exp) rule.

Rank ``i`` holds chunks ``i`` and ``2cp-1-i`` (``sharding.py``). At ring step ``t`` it holds the K/V block of rank
``j = (i - t) mod cp``; causality makes the work per step static and even:

- ``j == i`` (step 0): local queries against local keys, causal mask inside;
- ``j < i``: every local query attends only ``j``'s *early* chunk (its late chunk lies in the future);
- ``j > i``: only the local *late* chunk attends, to both of ``j``'s chunks (the early chunk precedes them all).

Packed documents: every CP rank has the full rows' document ids, so the ids of the block from rank ``j`` are sliced
locally (nothing but K/V travels). The per-micro-batch ints of ``RingAttentionInputs`` bound the mask (a key more
than ``max_seqlen_q``/``max_seqlen_k`` positions back, or before ``local_k_slice``, cannot share a query's
document), so they are real inputs that ``compile`` keeps symbolic.

Differentiability: K and V travel as one tensor through torch's functional-collective autograd all-to-all (a
rotation is an all-to-all whose only non-empty split goes to the next rank); its backward is the reverse rotation,
so dK/dV flow back around the ring to the rank that owns the block. One collective per hop each way keeps the
backward collective order a single dependency chain, identical on every rank. All control flow depends on Python
ints fixed per process (rank, ring size, step), never on tensor values: torch.compile traces the ring as one graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from nemo_ac.distributed.context_parallel.sharding import RingAttentionInputs, head_tail_positions
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.kernels.flex_attention import flex_packed_attention
from nemo_ac.models.kernels.packed_attention import packed_attention

# backend.attention -> the kernel of one ring step, ``(q, k, v, **ids) -> (out [B, sq, h, d], lse [B, h, sq])``.
# sdpa (and te, whose module has no ring form) use the dense reference blocks below.
RING_STEP_KERNELS = {"tiled": packed_attention, "flex": flex_packed_attention}

# (out_early, lse_early, out_late, lse_late): fp32 partial results for the rank's two query chunks.
RingState = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def ring_shift(x: torch.Tensor, *, group: dist.ProcessGroup | str, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Send ``x`` to rank ``cp_rank + 1`` and receive rank ``cp_rank - 1``'s (mod ``cp_size``); differentiable."""
    n = x.shape[0]
    send = [n if r == (cp_rank + 1) % cp_size else 0 for r in range(cp_size)]
    recv = [n if r == (cp_rank - 1) % cp_size else 0 for r in range(cp_size)]
    return funcol.all_to_all_single_autograd(x.contiguous(), recv, send, group)


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block with its log-sum-exp. q [B, h, sq, d], k/v [B, h, sk, d], mask [B, 1, sq, sk].

    Returns ``(out [B, h, sq, d], lse [B, h, sq])`` in fp32 (or the input dtype if wider). A query row with no
    allowed key gets out 0 and lse -inf (it then carries zero weight in ``merge_partials``); no NaN in forward or
    backward.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    # The row max only stabilizes exp(); out and lse do not depend on it, so it needs no gradient.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    has_key = denom > 0
    safe_denom = torch.where(has_key, denom, torch.ones_like(denom))
    out = torch.matmul(probs.to(v.dtype), v).to(acc) / safe_denom
    lse = torch.where(has_key, row_max + torch.log(safe_denom), torch.full_like(denom, float("-inf")))
    return out, lse.squeeze(-1)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets: each side is weighted by its share
    of the total softmax mass, ``exp(lse_side - lse)``. Rows empty on both sides stay (0, -inf); every gradient is
    finite (no ``log(0)`` or ``-inf - -inf`` on a differentiated path)."""
    # The max only stabilizes exp(); the result does not depend on it, so it needs no gradient.
    top = torch.maximum(lse_a, lse_b).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    has_mass = total > 0
    safe_total = torch.where(has_mass, total, torch.ones_like(total))
    out = (out_a * weight_a.unsqueeze(-1) + out_b * weight_b.unsqueeze(-1)) / safe_total.unsqueeze(-1)
    lse = torch.where(has_mass, top + torch.log(safe_total), torch.full_like(total, float("-inf")))
    return out, lse


def block_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor, k_doc: torch.Tensor, meta: RingAttentionInputs
) -> torch.Tensor:
    """[B, 1, sq, sk] True = attend: same document, causal, inside the per-micro-batch bounds; padding (-1) attends
    only itself (as ``document_causal_mask`` does for one process)."""
    back = q_pos.unsqueeze(-1) - k_pos.unsqueeze(0)  # [sq, sk] how far back the key is
    window = (back >= 0) & (back < meta.max_seqlen_q) & (back < meta.max_seqlen_k)
    window = window & (k_pos >= meta.local_k_slice).unsqueeze(0)
    same_doc = (q_doc.unsqueeze(-1) == k_doc.unsqueeze(1)) & (k_doc >= 0).unsqueeze(1)
    return ((same_doc & window) | (back == 0)).unsqueeze(1)


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GQA: [B, nkv, s, d] -> [B, nh, s, d] (query head h uses kv head h // (nh / nkv), as transformers does)."""
    return x if x.shape[1] == num_heads else x.repeat_interleave(num_heads // x.shape[1], dim=1)


def block_document_ids(meta: RingAttentionInputs, *, src: int, chunk: int, cp_size: int) -> torch.Tensor:
    """[B, 2 * chunk] document ids of ring rank ``src``'s head-tail chunks, sliced from the full rows every CP rank
    holds (only K/V travel around the ring)."""
    docs, late = meta.document_ids, 2 * cp_size - 1 - src
    return torch.cat((docs[:, src * chunk : (src + 1) * chunk], docs[:, late * chunk : (late + 1) * chunk]), dim=1)


def ring_block_update(
    state: RingState | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_doc: torch.Tensor,
    meta: RingAttentionInputs,
    src: int,
    cp_rank: int,
    cp_size: int,
    scale: float,
) -> RingState:
    """Fold the K/V block of ring rank ``src`` into this rank's partial results.

    q [B, nh, 2c, d] (this rank's chunks), k/v [B, nkv, 2c, d] (``src``'s chunks), q_doc [B, 2c]. The first call
    must be the diagonal block (``src == cp_rank``) with ``state=None``.
    """
    c = q.shape[2] // 2
    q_pos = head_tail_positions(c, cp_size=cp_size, cp_rank=cp_rank, device=q.device)
    k_pos = head_tail_positions(c, cp_size=cp_size, cp_rank=src, device=q.device)
    k_doc = block_document_ids(meta, src=src, chunk=c, cp_size=cp_size)
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    if src == cp_rank:
        if state is not None:
            raise ValueError("the diagonal block must come first")
        out, lse = block_attention(q, k, v, block_mask(q_pos, k_pos, q_doc, k_doc, meta), scale=scale)
        return out[:, :, :c], lse[:, :, :c], out[:, :, c:], lse[:, :, c:]
    if state is None:
        raise ValueError("the diagonal block must come first")
    out_early, lse_early, out_late, lse_late = state
    if src < cp_rank:  # only src's early chunk is in the past of the local queries
        mask = block_mask(q_pos, k_pos[:c], q_doc, k_doc[:, :c], meta)
        out, lse = block_attention(q, k[:, :, :c], v[:, :, :c], mask, scale=scale)
        out_early, lse_early = merge_partials(out_early, lse_early, out[:, :, :c], lse[:, :, :c])
        out_late, lse_late = merge_partials(out_late, lse_late, out[:, :, c:], lse[:, :, c:])
    else:  # only the local late chunk comes after src's chunks
        mask = block_mask(q_pos[c:], k_pos, q_doc[:, c:], k_doc, meta)
        out, lse = block_attention(q[:, :, c:], k, v, mask, scale=scale)
        out_late, lse_late = merge_partials(out_late, lse_late, out, lse)
    return out_early, lse_early, out_late, lse_late


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn: AttentionInputs,
    *,
    group: dist.ProcessGroup | str,
    cp_rank: int,
    cp_size: int,
    scale: float | None = None,
    kernel: str = "sdpa",
) -> torch.Tensor:
    """The ``Attention.attn_op`` for ``parallel.cp_type: ring``: q [B, s, nh, d], k/v [B, s, nkv, d] -> [B, s, nh, d],
    where ``s = 2 * chunk`` is this rank's head-tail shard.

    kernel: ``backend.attention``. ``tiled`` / ``flex`` run each step as one tiled (FlexAttention) call of the local
    queries against the received block, bounded by the ring ints, and merge the steps with the log-sum-exp; tiles
    (a whole step, when the block holds nothing visible) that cannot hold a visible pair are never computed.
    ``sdpa`` / ``te``: the dense reference blocks.
    """
    meta = attn.context_parallel
    if not isinstance(meta, RingAttentionInputs):
        raise TypeError(
            "ring context-parallel attention needs RingAttentionInputs in attn.context_parallel (the trainer's CP "
            f"batch preparer builds it for parallel.cp_type: ring); got {type(meta).__name__}"
        )
    if q.shape[1] % 2:
        raise ValueError(f"ring CP shard length {q.shape[1]} must be even (two head-tail chunks)")
    num_kv = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lse_kernel = kernel in RING_STEP_KERNELS
    qh = q.transpose(1, 2)
    kv = torch.cat((k, v), dim=2)  # one tensor per hop: one collective each way, a single backward chain
    state: RingState | tuple[torch.Tensor, torch.Tensor] | None = None
    for step in range(cp_size):
        # Start the next hop before computing this block so communication overlaps compute.
        incoming = ring_shift(kv, group=group, cp_rank=cp_rank, cp_size=cp_size) if step + 1 < cp_size else None
        k_blk, v_blk = kv.split(num_kv, dim=2)
        src = (cp_rank - step) % cp_size
        if lse_kernel:  # the local head-tail chunks against the whole block, merged by log-sum-exp
            state = ring_kernel_step(
                state,
                q,
                k_blk,
                v_blk,
                q_doc=attn.document_ids,
                meta=meta,
                src=src,
                cp_rank=cp_rank,
                cp_size=cp_size,
                scale=scale,
                kernel=kernel,
            )
        else:  # dense reference blocks, causally split per chunk
            state = ring_block_update(
                state,
                qh,
                k_blk.transpose(1, 2),
                v_blk.transpose(1, 2),
                q_doc=attn.document_ids,
                meta=meta,
                src=src,
                cp_rank=cp_rank,
                cp_size=cp_size,
                scale=scale,
            )
        kv = incoming
    out = state[0] if lse_kernel else torch.cat((state[0], state[2]), dim=2)
    return out.transpose(1, 2).to(q.dtype)


def ring_kernel_step(
    acc: tuple[torch.Tensor, torch.Tensor] | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_doc: torch.Tensor,
    meta: RingAttentionInputs,
    src: int,
    cp_rank: int,
    cp_size: int,
    scale: float,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold ring rank ``src``'s K/V block into this rank's ``(out [B, h, 2c, d], lse [B, h, 2c])`` with a
    log-sum-exp kernel. q [B, 2c, nh, d] (the local head-tail chunks), k / v [B, 2c, nkv, d] (``src``'s chunks)."""
    c = q.shape[1] // 2
    out, lse = RING_STEP_KERNELS[kernel](
        q,
        k,
        v,
        q_doc=q_doc,
        k_doc=block_document_ids(meta, src=src, chunk=c, cp_size=cp_size),
        q_pos=head_tail_positions(c, cp_size=cp_size, cp_rank=cp_rank, device=q.device),
        k_pos=head_tail_positions(c, cp_size=cp_size, cp_rank=src, device=q.device),
        scale=scale,
        # No visible key lies before local_k_slice or further back than the longest document: real work bounds.
        min_k_pos=meta.local_k_slice,
        max_back=torch.sym_min(meta.max_seqlen_q, meta.max_seqlen_k),
    )
    # [B, h, 2c, d], as merge_partials takes it; the kernels return ``out`` in q's dtype and ``lse`` in fp32, and the
    # steps merge in fp32 (as ring flash-attention merges the fused kernels' bf16 step outputs).
    out = out.transpose(1, 2).to(lse.dtype)
    return (out, lse) if acc is None else merge_partials(acc[0], acc[1], out, lse)
