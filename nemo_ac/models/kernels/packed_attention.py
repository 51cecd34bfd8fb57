"""Packed-document attention: memory linear in the sequence, work proportional to the visible pairs.

The dense reference (``attention.packed_causal_attention``) hands SDPA a [B, 1, S, S] mask and SDPA's CPU / math
paths build [B, h, S, S] scores: memory and FLOPs grow with S squared even when a packed row holds many short
documents, where almost every pair is masked. This op never builds an [S, S] tensor. It has two kernels, chosen per
call from the ids (``tile``: ``TILE_AUTO``, or a tile edge to force the tiled loop, or ``DENSE_SPANS``):

- dense document spans (``packed_attention_spans``): each document's visible pairs as at most two dense blocks
  (keys before the queries, a causal diagonal block) handed to SDPA's fused CPU flash kernel, partial results merged
  by log-sum-exp. Chosen where the ids allow it and the documents are long enough (``SPAN_MIN_RUN``): one long
  document runs at SDPA ``is_causal`` speed, 512-token documents at a fraction of the dense-mask time;
- tiles (below, the general path and the reference for the spans): queries and keys are cut into tiles of
  ``tile`` positions (per shape: ``choose_tile``); a (query tile, key tile) pair is computed only when it can hold
  a visible pair: the tiles' document-id ranges overlap and the key tile starts at or before the query tile's last
  position (or their positions meet: padding attends only itself), computed on the device from the document ids and
  positions the data path already produces. Visible pairs are processed a bounded number at a time
  (``pairs_per_chunk``) with an online softmax, so memory is the output, its log-sum-exp and one chunk of scores.

Both compute each visible tile pair once forward and once more in backward, which recomputes the scores from the
saved log-sum-exp (flash-style; forward saves only the output and the log-sum-exp). The mask is exact (same
document, causal, padding attends itself), so results equal the dense reference: fp64 to round-off, fp32 to ~1e-6.

It is one ``torch.library`` custom op (``nemo_ac::packed_attention``, backward ``nemo_ac::packed_attention_backward``):
``torch.compile`` sees one opaque node whose output shapes depend on q alone (no recompile per document layout,
the number of visible tiles never becomes a guard), and selective AC saves its outputs whole (the policy lists it
with the attention ops), so the recompute never reruns it. Its FLOP formula counts the visible pairs
(``packed_attention_flops``), whichever kernel runs them.

Queries and keys carry their own document ids and global positions, so the same op serves the local path, the
Ulysses inner op (full sequence, a head shard) and each ring step (local head-tail chunks against another rank's
chunks); the returned log-sum-exp is what the ring merges partial results with. GQA needs no repeated K/V: the
query heads of one K/V head are stacked as extra query rows (tiles) or read by the kernel (spans).
"""

from __future__ import annotations

import torch

from nemo_ac.models.kernels import packed_attention_spans as spans
from nemo_ac.models.kernels.op_flops import register_op_flops
from nemo_ac.models.kernels.packed_attention_flops import (
    UNBOUNDED,
    PackedIds,
    packed_attention_backward_flops,
    packed_attention_flops,
    visible_pairs,
)
from nemo_ac.models.kernels.packed_attention_tiles import (
    CHUNK_ELEMENTS,
    _acc_dtype,
    _pair_mask,
    _Tiled,
    choose_tile,
    tiled_attention_backward,
    tiled_attention_forward,
    visible_tile_pairs,
)

# Re-exported: the tiled loop and the pair count are read through this module by the ring, the benchmarks and tests.
__all__ = [
    "CHUNK_ELEMENTS",
    "UNBOUNDED",
    "PackedIds",
    "_Tiled",
    "_pair_mask",
    "choose_tile",
    "packed_attention",
    "tiled_attention_backward",
    "tiled_attention_forward",
    "visible_pairs",
    "visible_tile_pairs",
]

# The op's ``tile`` argument: TILE_AUTO picks the kernel and the tile edge per call; DENSE_SPANS asks for the dense
# spans (the tiled loop where the ids do not allow them); a positive edge forces the tiled loop with it.
TILE_AUTO = 0
DENSE_SPANS = -1
# What ``packed_attention`` passes when the caller gives no tile.
DEFAULT_TILE = TILE_AUTO
# Dense spans under TILE_AUTO when the query runs (documents, cut at chunk edges) average at least this many
# positions: below it the per-block kernel calls cost more than the tiled loop's masked work
# (benchmarks/packed_attention.py --table crossover).
SPAN_MIN_RUN = 64

# ------------------------------------------------------------------------------------------------------------
# the kernel choice: dense spans or tiles


def span_plan(q: torch.Tensor, ids: PackedIds, *, tile: int) -> spans.SpanPlan | None:
    """The dense spans of this call, or None for the tiled loop: a positive ``tile`` forces tiles; the fused kernel
    is torch's CPU one; under ``TILE_AUTO`` the query runs must average ``SPAN_MIN_RUN`` positions."""
    if tile > 0 or q.device.type != "cpu" or q.shape[1] == 0 or ids.k_doc.shape[1] == 0:
        return None
    plan = spans.plan_spans(ids)
    if plan is None or (tile == TILE_AUTO and plan.mean_query_run(ids.q_doc.numel()) < SPAN_MIN_RUN):
        return None
    return plan


def packed_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: PackedIds, *, scale: float, tile: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's forward: the dense spans where ``span_plan`` allows them, else the tiled loop. Both accumulate in
    fp32; ``out`` leaves in q's dtype (see ``packed_attention_op``)."""
    plan = span_plan(q, ids, tile=tile)
    if plan is not None:
        out, lse = spans.spans_forward(q, k, v, plan, scale=scale)
    else:
        out, lse = tiled_attention_forward(q, k, v, ids, scale=scale, tile=tile)
    return out.to(q.dtype), lse


def packed_attention_backward(
    grads: tuple[torch.Tensor, torch.Tensor],
    saved: tuple[torch.Tensor, ...],
    ids: PackedIds,
    *,
    scale: float,
    tile: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's backward, same choice as the forward (both kernels read the same saved output and log-sum-exp):
    ``grads`` = (grad_out, grad_lse), ``saved`` = (q, k, v, out, lse)."""
    (grad_out, grad_lse), (q, k, v, out, lse) = grads, saved
    plan = span_plan(q, ids, tile=tile)
    if plan is not None:
        result = spans.spans_backward(grad_out, grad_lse, q, k, v, out, lse, plan, scale=scale)
        if result is not None:
            return tuple(g.contiguous() for g in result)
    return tiled_attention_backward(grad_out, q, k, v, out, lse, ids, scale=scale, tile=tile, grad_lse=grad_lse)


# ------------------------------------------------------------------------------------------------------------
# the custom op: one node to torch.compile and to selective AC


@torch.library.custom_op("nemo_ac::packed_attention", mutates_args=())
def packed_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    tile: int,
    min_k_pos: int,
    max_back: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Sq, h, d] in q's dtype, lse [B, h, Sq] in fp32, or fp64 for fp64 inputs)``; see the module
    docstring.

    ``out`` leaves in q's dtype, as SDPA's and flash-attn's do: with an fp32 ``out`` every bf16 call paid four
    full-size casts around the op (fp32 out -> bf16 for o_proj, its grad back to fp32, both cast again for the fused
    kernel's backward) and saved a twice-as-large ``out`` for backward; one bf16 document at 2k ran at 1.22x SDPA's
    time (profile: ``aten::copy_ <- aten::_to_copy <- aten::to <- tiled_packed_attention``). ``lse`` stays fp32: the
    ring merges step results with it, and ``merge_partials`` upcasts the bf16 partial ``out`` to fp32 as it weighs
    them."""
    ids = PackedIds(q_doc=q_doc, k_doc=k_doc, q_pos=q_pos, k_pos=k_pos, min_k_pos=min_k_pos, max_back=max_back)
    return packed_attention_forward(q, k, v, ids, scale=scale, tile=tile)


@packed_attention_op.register_fake
def _(q, k, v, q_doc, k_doc, q_pos, k_pos, scale, tile, min_k_pos, max_back):
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=_acc_dtype(q.dtype))


@torch.library.custom_op("nemo_ac::packed_attention_backward", mutates_args=())
def packed_attention_backward_op(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    tile: int,
    min_k_pos: int,
    max_back: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = PackedIds(q_doc=q_doc, k_doc=k_doc, q_pos=q_pos, k_pos=k_pos, min_k_pos=min_k_pos, max_back=max_back)
    return packed_attention_backward((grad_out, grad_lse), (q, k, v, out, lse), ids, scale=scale, tile=tile)


@packed_attention_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, q_doc, k_doc, q_pos, k_pos, out, lse, scale, tile, min_k_pos, max_back):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_doc, k_doc, q_pos, k_pos, scale, tile, min_k_pos, max_back = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, q_doc, k_doc, q_pos, k_pos, out, lse)
    ctx.args = (scale, tile, min_k_pos, max_back)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, q_doc, k_doc, q_pos, k_pos, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    dq, dk, dv = packed_attention_backward_op(
        grad_out.contiguous(), grad_lse.contiguous(), q, k, v, q_doc, k_doc, q_pos, k_pos, out, lse, *ctx.args
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


packed_attention_op.register_autograd(_backward, setup_context=_setup_context)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float | None = None,
    tile: int | None = None,
    min_k_pos: int = 0,
    max_back: int = UNBOUNDED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q [B, Sq, h, d] over keys k / v [B, Sk, hkv, d] where query i sees key j iff they share
    a document (``q_doc`` [B, Sq], ``k_doc`` [B, Sk], -1 = padding) and ``k_pos[j] <= q_pos[i]`` (global positions,
    [Sq] / [Sk] or per row) and, a bound on the work, ``min_k_pos <= k_pos[j]`` and ``q_pos[i] - k_pos[j] <
    max_back`` (the per-micro-batch ints: the longest document, ring CP's ``local_k_slice``); or ``k_pos[j] ==
    q_pos[i]``. Returns ``(out [B, Sq, h, d], lse [B, h, Sq])``: ``out`` in q's dtype, ``lse`` in fp32 (fp64 for
    fp64 inputs)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    tile = DEFAULT_TILE if tile is None else tile
    return packed_attention_op(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        q_doc,
        k_doc,
        q_pos,
        k_pos,
        float(scale),
        tile,
        min_k_pos,
        max_back,
    )


register_op_flops(torch.ops.nemo_ac.packed_attention, packed_attention_flops, get_raw=True)
register_op_flops(torch.ops.nemo_ac.packed_attention_backward, packed_attention_backward_flops, get_raw=True)
