"""Packed-document attention in tiles: memory linear in the sequence, work proportional to the visible pairs.

The dense reference (``attention.packed_causal_attention``) hands SDPA a [B, 1, S, S] mask and SDPA's CPU / math
paths build [B, h, S, S] scores: memory and FLOPs grow with S squared even when a packed row holds many short
documents, where almost every pair is masked. This op never builds an [S, S] tensor:

- queries and keys are cut into tiles of ``tile`` positions; a (query tile, key tile) pair is computed only when it
  can hold a visible pair: the tiles' document-id ranges overlap and the key tile starts at or before the query
  tile's last position (or their positions meet: padding attends only itself). Which pairs those are is computed
  on the device from the document ids and positions the data path already produces;
- visible pairs are processed a bounded number at a time (``pairs_per_chunk``) with an online softmax, so memory is
  the output, its log-sum-exp and one chunk of scores, whatever S is;
- forward saves only the output and the log-sum-exp; backward recomputes each chunk's scores (flash-style);
- inside a computed tile the mask is exact (same document, causal, padding attends itself), so results equal the
  dense reference: fp64 to round-off, fp32 to ~1e-6.

It is one ``torch.library`` custom op (``nemo_ac::packed_attention``, backward ``nemo_ac::packed_attention_backward``):
``torch.compile`` sees one opaque node whose output shapes depend on q alone (no recompile per document layout,
the number of visible tiles never becomes a guard), and selective AC saves its outputs whole (the policy lists it
with the attention ops), so the recompute never reruns it.

Queries and keys carry their own document ids and global positions, so the same op serves the local path, the
Ulysses inner op (full sequence, a head shard) and each ring step (local head-tail chunks against another rank's
chunks); the returned log-sum-exp is what the ring merges partial results with. GQA needs no repeated K/V: the
query heads of one K/V head are stacked as extra query rows.
"""

from __future__ import annotations

import warnings

import torch

from nemo_ac.models.common.op_flops import register_op_flops

# Default tile edge: 32 keeps the computed pairs within ~1.1x of the visible ones for 512-token documents (64:
# ~1.3x, and ~25% faster on CPU: benchmarks/packed_attention.py --tile 64); ring chunks and rows of multiples of 32
# never straddle a tile.
DEFAULT_TILE = 32
# Scores of at most this many query-key elements per head exist at a time (one chunk of tile pairs):
# x heads x 4 bytes, e.g. 1 MiB per head.
CHUNK_ELEMENTS = 64 * 64 * 64

_Q_PAD_DOC, _K_PAD_DOC = -2, -3  # doc ids of the positions added to fill the last tile (match nothing)
_Q_PAD_POS, _K_PAD_POS = -1, 2**40  # positions that never meet a real one
UNBOUNDED = 2**62  # max_back without a bound


def _padded(x: torch.Tensor, length: int, value: float | int) -> torch.Tensor:
    """Pad dim 1 of ``x`` to ``length`` with ``value``."""
    extra = length - x.shape[1]
    if extra == 0:
        return x
    pad = x.new_full((x.shape[0], extra, *x.shape[2:]), value)
    return torch.cat((x, pad), dim=1)


def _tiles(n: int, tile: int) -> int:
    return -(-n // tile)


def visible_tile_pairs(
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    tile: int,
    min_k_pos: int = 0,
    max_back: int = UNBOUNDED,
) -> torch.Tensor:
    """[P, 2] (query tile, key tile) indices over the flattened [B * tiles] of every pair that may hold a visible
    (same document, causal, inside the window) or diagonal position pair, sorted by query tile. Inputs are padded
    to whole tiles."""
    b, sq = q_doc.shape
    sk = k_doc.shape[1]
    nq, nk = sq // tile, sk // tile
    qd, kd = q_doc.reshape(b, nq, tile), k_doc.reshape(b, nk, tile)
    qp, kp = q_pos.reshape(b, nq, tile), k_pos.reshape(b, nk, tile)
    q_lo, q_hi = qd.amin(-1), qd.amax(-1)
    k_lo, k_hi = kd.amin(-1), kd.amax(-1)
    qp_lo, qp_hi = qp.amin(-1), qp.amax(-1)
    kp_lo, kp_hi = kp.amin(-1), kp.amax(-1)
    docs_meet = (k_lo[:, None, :] <= q_hi[:, :, None]) & (q_lo[:, :, None] <= k_hi[:, None, :])
    causal = kp_lo[:, None, :] <= qp_hi[:, :, None]
    positions_meet = causal & (qp_lo[:, :, None] <= kp_hi[:, None, :])
    # The window: no visible key lies before min_k_pos or max_back or more positions behind its query.
    in_window = (kp_hi >= min_k_pos)[:, None, :] & (qp_lo[:, :, None] - kp_hi[:, None, :] < max_back)
    visible = (docs_meet & causal & in_window) | positions_meet  # [B, nq, nk]
    batch, qi, ki = visible.nonzero(as_tuple=True)
    return torch.stack((batch * nq + qi, batch * nk + ki), dim=1)


def _pair_mask(
    qd: torch.Tensor, kd: torch.Tensor, qp: torch.Tensor, kp: torch.Tensor, *, min_k_pos: int, max_back: int
) -> torch.Tensor:
    """[P, T, T] exact mask of gathered tile pairs: same document, causal, inside the window; padding (-1) attends
    only itself."""
    same = (qd[:, :, None] == kd[:, None, :]) & (kd >= 0)[:, None, :]
    back = qp[:, :, None] - kp[:, None, :]
    window = (back >= 0) & (back < max_back) & (kp >= min_k_pos)[:, None, :]
    return (same & window) | (back == 0)


class _Tiled:
    """q / k / v / ids cut into tiles: q [NQ, hkv, g*T, d] (a K/V head's g query heads stacked as rows),
    k / v [NK, hkv, T, d], ids [N, T]."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_doc: torch.Tensor,
        k_doc: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        tile: int,
        min_k_pos: int = 0,
        max_back: int = UNBOUNDED,
    ) -> None:
        b, sq, h, d = q.shape
        self.min_k_pos, self.max_back = min_k_pos, max_back
        sk, hkv = k.shape[1], k.shape[2]
        if h % hkv:
            raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
        self.b, self.sq, self.sk, self.h, self.hkv, self.d, self.g, self.tile = b, sq, sk, h, hkv, d, h // hkv, tile
        self.nq, self.nk = _tiles(sq, tile), _tiles(sk, tile)
        sq_pad, sk_pad = self.nq * tile, self.nk * tile
        self.q_doc = _padded(q_doc.to(torch.int64), sq_pad, _Q_PAD_DOC)
        self.k_doc = _padded(k_doc.to(torch.int64), sk_pad, _K_PAD_DOC)
        self.q_pos = _padded(q_pos.to(torch.int64).expand(b, sq), sq_pad, _Q_PAD_POS)
        self.k_pos = _padded(k_pos.to(torch.int64).expand(b, sk), sk_pad, _K_PAD_POS)
        self.q = self.tile_queries(q)
        self.k = self.tile_keys(k)
        self.v = self.tile_keys(v)

    def tile_queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Sq, h, e] -> [NQ, hkv, g*T, e]."""
        x = _padded(x, self.nq * self.tile, 0)
        x = x.view(self.b, self.nq, self.tile, self.hkv, self.g, x.shape[-1])
        return x.permute(0, 1, 3, 4, 2, 5).reshape(self.b * self.nq, self.hkv, self.g * self.tile, x.shape[-1])

    def untile_queries(self, x: torch.Tensor) -> torch.Tensor:
        """[NQ, hkv, g*T, e] -> [B, Sq, h, e]."""
        e = x.shape[-1]
        x = x.view(self.b, self.nq, self.hkv, self.g, self.tile, e).permute(0, 1, 4, 2, 3, 5)
        return x.reshape(self.b, self.nq * self.tile, self.h, e)[:, : self.sq]

    def tile_keys(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Sk, hkv, e] -> [NK, hkv, T, e]."""
        x = _padded(x, self.nk * self.tile, 0)
        x = x.view(self.b, self.nk, self.tile, self.hkv, x.shape[-1]).permute(0, 1, 3, 2, 4)
        return x.reshape(self.b * self.nk, self.hkv, self.tile, x.shape[-1])

    def untile_keys(self, x: torch.Tensor) -> torch.Tensor:
        """[NK, hkv, T, e] -> [B, Sk, hkv, e]."""
        e = x.shape[-1]
        x = x.view(self.b, self.nk, self.hkv, self.tile, e).permute(0, 1, 3, 2, 4)
        return x.reshape(self.b, self.nk * self.tile, self.hkv, e)[:, : self.sk]

    def row_ids(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.tile
        return (
            self.q_doc.reshape(-1, t),
            self.k_doc.reshape(-1, t),
            self.q_pos.reshape(-1, t),
            self.k_pos.reshape(-1, t),
        )

    def pairs(self) -> torch.Tensor:
        return visible_tile_pairs(
            self.q_doc,
            self.k_doc,
            self.q_pos,
            self.k_pos,
            tile=self.tile,
            min_k_pos=self.min_k_pos,
            max_back=self.max_back,
        )

    def scores(self, qi: torch.Tensor, ki: torch.Tensor, *, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """[P, hkv, g*T, T] scaled scores of the pairs in ``dtype``, -inf where the exact mask hides a pair (the
        forward and the backward's recompute compute them alike)."""
        scores = torch.matmul(self.q[qi], self.k[ki].transpose(-1, -2)).to(dtype) * scale
        return scores.masked_fill(~self.mask(qi, ki), float("-inf"))

    def mask(self, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        """[P, 1, g*T, T] exact mask of the pairs (broadcast over K/V heads, repeated over a head group's rows)."""
        qd, kd, qp, kp = self.row_ids()
        m = _pair_mask(qd[qi], kd[ki], qp[qi], kp[ki], min_k_pos=self.min_k_pos, max_back=self.max_back)
        return m[:, None, None].expand(-1, 1, self.g, -1, -1).reshape(m.shape[0], 1, self.g * self.tile, self.tile)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _pairs_per_chunk(tile: int) -> int:
    return max(1, CHUNK_ELEMENTS // (tile * tile))


def _chunks(pairs: torch.Tensor, size: int):
    """Chunks of at most ``size`` pairs: ``(qi, ki, lo, hi)`` with every qi in ``[lo, hi)`` (pairs are sorted by query
    tile, so a chunk touches one contiguous range of query tiles; the range comes from one host copy of the pairs,
    not a device sync per chunk)."""
    host = pairs[:, 0].cpu()
    for start in range(0, pairs.shape[0], size):
        stop = min(start + size, pairs.shape[0])
        chunk = pairs[start:stop]
        yield chunk[:, 0], chunk[:, 1], int(host[start]), int(host[stop - 1]) + 1


def tiled_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float,
    tile: int | None = None,
    min_k_pos: int = 0,
    max_back: int = UNBOUNDED,
    pairs_per_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's forward in plain torch: ``(out [B, Sq, h, d], lse [B, h, Sq])``, both in fp32 (or wider, for fp64
    inputs): the ring merges partial results at that precision; the local path casts ``out`` back.

    A query row with no visible key (possible in a ring step) gets out 0 and lse -inf.
    """
    tile = DEFAULT_TILE if tile is None else tile
    t = _Tiled(q, k, v, q_doc, k_doc, q_pos, k_pos, tile, min_k_pos, max_back)
    acc = _acc_dtype(q.dtype)
    rows = t.g * tile
    m_run = torch.full((t.b * t.nq, t.hkv, rows), float("-inf"), dtype=acc, device=q.device)
    l_run = torch.zeros_like(m_run)
    o_run = torch.zeros((t.b * t.nq, t.hkv, rows, t.d), dtype=acc, device=q.device)
    for qi, ki, lo, hi in _chunks(t.pairs(), pairs_per_chunk or _pairs_per_chunk(tile)):
        scores = t.scores(qi, ki, scale=scale, dtype=acc)
        local = qi - lo  # the chunk's query tiles within [lo, hi): only those accumulators are touched
        index = local[:, None, None].expand(-1, t.hkv, rows)
        m_old = m_run[lo:hi]
        m_new = m_old.scatter_reduce(0, index, scores.amax(-1), reduce="amax")
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        rescale = torch.exp(m_old - m_safe)  # exp(-inf) = 0 where nothing was accumulated yet
        probs = torch.exp(scores - m_safe[local].unsqueeze(-1))
        l_run[lo:hi].mul_(rescale).index_add_(0, local, probs.sum(-1))
        o_run[lo:hi].mul_(rescale.unsqueeze(-1)).index_add_(0, local, torch.matmul(probs.to(v.dtype), t.v[ki]).to(acc))
        m_run[lo:hi] = m_new
    has_key = l_run > 0
    safe_l = torch.where(has_key, l_run, torch.ones_like(l_run))
    out = o_run / safe_l.unsqueeze(-1)
    m_safe = torch.where(torch.isfinite(m_run), m_run, torch.zeros_like(m_run))
    lse = torch.where(has_key, m_safe + torch.log(safe_l), torch.full_like(l_run, float("-inf")))
    out = t.untile_queries(out)
    lse = t.untile_queries(lse.unsqueeze(-1)).squeeze(-1).transpose(1, 2)  # [B, h, Sq]
    return out.contiguous(), lse.contiguous()


def tiled_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    tile: int | None = None,
    min_k_pos: int = 0,
    max_back: int = UNBOUNDED,
    pairs_per_chunk: int | None = None,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the forward, recomputing each chunk's scores from the saved log-sum-exp.

    ``grad_lse`` (the ring merge differentiates through the log-sum-exp): d lse / d s = softmax, so it adds
    ``probs * grad_lse`` to d scores.
    """
    tile = DEFAULT_TILE if tile is None else tile
    t = _Tiled(q, k, v, q_doc, k_doc, q_pos, k_pos, tile, min_k_pos, max_back)
    acc = _acc_dtype(q.dtype)
    rows = t.g * tile
    do = t.tile_queries(grad_out.to(acc))
    o = t.tile_queries(out.to(acc))
    lse_t = t.tile_queries(lse.transpose(1, 2).unsqueeze(-1).to(acc)).squeeze(-1)  # [NQ, hkv, rows]
    delta = (do * o).sum(-1)
    if grad_lse is not None:
        delta = delta - t.tile_queries(grad_lse.transpose(1, 2).unsqueeze(-1).to(acc)).squeeze(-1)
    lse_safe = torch.where(torch.isfinite(lse_t), lse_t, torch.full_like(lse_t, float("inf")))
    dq = torch.zeros((t.b * t.nq, t.hkv, rows, t.d), dtype=acc, device=q.device)
    dk = torch.zeros((t.b * t.nk, t.hkv, tile, t.d), dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    qa, ka, va = t.q.to(acc), t.k.to(acc), t.v.to(acc)
    for qi, ki, _, _ in _chunks(t.pairs(), pairs_per_chunk or _pairs_per_chunk(tile)):
        scores = t.scores(qi, ki, scale=scale, dtype=acc)
        probs = torch.exp(scores - lse_safe[qi].unsqueeze(-1))  # rows without keys: exp(-inf) = 0
        dv.index_add_(0, ki, torch.matmul(probs.transpose(-1, -2), do[qi]))
        dprobs = torch.matmul(do[qi], va[ki].transpose(-1, -2))
        dscores = probs * (dprobs - delta[qi].unsqueeze(-1)) * scale
        dq.index_add_(0, qi, torch.matmul(dscores, ka[ki]))
        dk.index_add_(0, ki, torch.matmul(dscores.transpose(-1, -2), qa[qi]))
    return (
        t.untile_queries(dq).to(q.dtype).contiguous(),
        t.untile_keys(dk).to(k.dtype).contiguous(),
        t.untile_keys(dv).to(v.dtype).contiguous(),
    )


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
    """``(out [B, Sq, h, d], lse [B, h, Sq])`` in fp32 (or wider); see the module docstring."""
    return tiled_attention_forward(
        q, k, v, q_doc, k_doc, q_pos, k_pos, scale=scale, tile=tile, min_k_pos=min_k_pos, max_back=max_back
    )


@packed_attention_op.register_fake
def _(q, k, v, q_doc, k_doc, q_pos, k_pos, scale, tile, min_k_pos, max_back):
    b, sq, h, _ = q.shape
    acc = _acc_dtype(q.dtype)
    return q.new_empty(q.shape, dtype=acc), q.new_empty((b, h, sq), dtype=acc)


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
    return tiled_attention_backward(
        grad_out,
        q,
        k,
        v,
        q_doc,
        k_doc,
        q_pos,
        k_pos,
        out,
        lse,
        scale=scale,
        tile=tile,
        min_k_pos=min_k_pos,
        max_back=max_back,
        grad_lse=grad_lse,
    )


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
    q_pos[i]``. Returns ``(out [B, Sq, h, d], lse [B, h, Sq])`` in fp32
    (fp64 for fp64 inputs)."""
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


# ------------------------------------------------------------------------------------------------------------
# FLOPs: what the layer must compute, the visible (query, key) pairs (FlopCounterMode, the profiler, nemo-ac plan)

_POS_SPAN = 2**41  # > any position (the op's own key padding is 2**40); doc * span + pos orders by (doc, pos)


def _as_rows(pos: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    return pos.to(torch.int64).reshape(-1, length).expand(rows, length)


def visible_pairs(
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    min_k_pos: int = 0,
    max_back: int = UNBOUNDED,
) -> int:
    """How many (query, key) pairs ``packed_attention`` lets attend, summed over rows: same document (ids >= 0),
    ``0 <= q_pos - k_pos < max_back`` and ``k_pos >= min_k_pos``; or equal positions (padding attends itself). The
    rule of the op's exact mask (``_pair_mask``), counted with sorted keys in O(S log S) per row, never an [S, S]."""
    rows, sq = q_doc.shape
    sk = k_doc.shape[1]
    total = 0
    for qd, kd, qp, kp in zip(q_doc.to(torch.int64), k_doc.to(torch.int64), _as_rows(q_pos, rows, sq),
                              _as_rows(k_pos, rows, sk), strict=True):  # fmt: skip
        keys = torch.sort(kd * _POS_SPAN + kp).values
        valid = qd >= 0
        base = qd * _POS_SPAN
        lowest = torch.clamp(qp - max_back + 1, min=min_k_pos)
        lo = torch.searchsorted(keys, base + lowest)
        hi = torch.searchsorted(keys, base + qp, right=True)
        in_window = torch.where(valid & (lowest <= qp), hi - lo, torch.zeros_like(hi))
        # Equal positions outside the first set: a key at the query's position of another (or no) document.
        positions = torch.sort(kp).values
        same_pos = torch.searchsorted(positions, qp, right=True) - torch.searchsorted(positions, qp)
        own = hi - torch.searchsorted(keys, base + qp)  # same document, same position (counted above if valid)
        counted_own = torch.where(valid & (qp >= min_k_pos) & (max_back > 0), own, torch.zeros_like(own))
        total += int(in_window.sum()) + int((same_pos - counted_own).sum())
    return total


_FAKE_DOCS_WARNED: set[str] = set()
# visible_pairs per (ids, window): every layer of a micro batch asks again for the same ids (a few entries suffice).
_PAIRS_CACHE: dict[tuple, int] = {}
_PAIRS_CACHE_SIZE = 16


def _cached_pairs(
    q_doc: torch.Tensor, k_doc: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, min_k_pos: int, max_back: int
) -> int:
    key = (
        *(tuple(t.shape) for t in (q_doc, k_doc, q_pos, k_pos)),
        *(hash(t.detach().cpu().contiguous().numpy().tobytes()) for t in (q_doc, k_doc, q_pos, k_pos)),
        min_k_pos,
        max_back,
    )
    if key not in _PAIRS_CACHE:
        if len(_PAIRS_CACHE) >= _PAIRS_CACHE_SIZE:
            _PAIRS_CACHE.pop(next(iter(_PAIRS_CACHE)))
        _PAIRS_CACHE[key] = visible_pairs(q_doc, k_doc, q_pos, k_pos, min_k_pos=min_k_pos, max_back=max_back)
    return _PAIRS_CACHE[key]


def _pairs_or_bound(
    q_doc: torch.Tensor, k_doc: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, min_k_pos: int, max_back: int
) -> int:
    """``visible_pairs``, or, when the ids carry no values (fake or meta tensors), the causal bound of one document
    per row, with a warning naming it (never a silent 0)."""
    try:
        return _cached_pairs(q_doc, k_doc, q_pos, k_pos, min_k_pos, max_back)
    except (RuntimeError, NotImplementedError) as exc:  # DataDependentOutputException, meta tensors
        if "packed_attention" not in _FAKE_DOCS_WARNED:
            _FAKE_DOCS_WARNED.add("packed_attention")
            warnings.warn(
                f"nemo_ac::packed_attention FLOPs: its document ids hold no values here ({type(exc).__name__}); "
                "counted as one causal document per row (an upper bound)",
                stacklevel=2,
            )
        rows, sq = q_doc.shape
        sk = k_doc.shape[1]
        return rows * sum(min(i + 1, sk) for i in range(sq)) if sq <= 65536 else rows * sq * (sq + 1) // 2


def packed_attention_flops(
    q, k, v, q_doc, k_doc, q_pos, k_pos, scale, tile, min_k_pos, max_back, *, out_val: object = None
) -> int:
    """Forward: scores (q . k) and the weighted sum (p . v) over the visible pairs, for every query head."""
    heads, d_qk, d_v = q.shape[2], q.shape[3], v.shape[3]
    return 2 * _pairs_or_bound(q_doc, k_doc, q_pos, k_pos, min_k_pos, max_back) * heads * (d_qk + d_v)


def packed_attention_backward_flops(
    grad_out, grad_lse, q, k, v, q_doc, k_doc, q_pos, k_pos, out, lse, scale, tile, min_k_pos, max_back,
    *, out_val: object = None,
) -> int:  # fmt: skip
    """Backward, torch's SDPA convention: the recomputed scores, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q."""
    heads, d_qk, d_v = q.shape[2], q.shape[3], v.shape[3]
    pairs = _pairs_or_bound(q_doc, k_doc, q_pos, k_pos, min_k_pos, max_back)
    return 2 * pairs * heads * (3 * d_qk + 2 * d_v)


register_op_flops(torch.ops.nemo_ac.packed_attention, packed_attention_flops, get_raw=True)
register_op_flops(torch.ops.nemo_ac.packed_attention_backward, packed_attention_backward_flops, get_raw=True)
