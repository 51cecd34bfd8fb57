"""The tiled loop of ``nemo_ac::packed_attention`` (see ``packed_attention`` for the op and the kernel choice).

Queries and keys are cut into tiles of ``tile`` positions; a (query tile, key tile) pair is computed only when it
can hold a visible pair: the tiles' document-id ranges overlap and the key tile starts at or before the query
tile's last position (or their positions meet: padding attends only itself). Which pairs those are is computed on
the device from the document ids and positions. Visible pairs are processed a bounded number at a time
(``pairs_per_chunk``) with an online softmax, so memory is the output, its log-sum-exp and one chunk of scores,
whatever S is; forward saves only the output and the log-sum-exp and backward recomputes each chunk's scores
(flash-style). Inside a computed tile the mask is exact (same document, causal, padding attends itself).

It runs everywhere, with any ids (windows that cut documents, positions in any order), and is the reference the
dense spans (``packed_attention_spans``) are tested against.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nemo_ac.models.kernels.packed_attention_flops import UNBOUNDED, PackedIds

# Scores of at most this many query-key elements per head exist at a time (one chunk of tile pairs):
# x heads x 4 bytes, e.g. 1 MiB per head.
CHUNK_ELEMENTS = 64 * 64 * 64

_Q_PAD_DOC, _K_PAD_DOC = -2, -3  # doc ids of the positions added to fill the last tile (match nothing)
_Q_PAD_POS, _K_PAD_POS = -1, 2**40  # positions that never meet a real one


def choose_tile(max_back: int) -> int:
    """The tiled loop's edge from the window (the longest document): 16 for documents of <= 64 positions, 32 up to
    1024 (computed pairs within ~1.1x of the visible ones for 512-token documents), 64 beyond (~1.3x there, but
    fewer gathers: ~25% faster per visible pair on CPU)."""
    if max_back <= 64:
        return 16
    return 32 if max_back <= 1024 else 64


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
    k / v [NK, hkv, T, d], ids [N, T]; the forward and the backward walk its visible tile pairs with ``chunks``.
    ``tile`` None or <= 0: ``choose_tile`` from the window."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: PackedIds, *, tile: int | None) -> None:
        tile = choose_tile(ids.max_back) if tile is None or tile <= 0 else tile
        b, sq, h, d = q.shape
        self.min_k_pos, self.max_back = ids.min_k_pos, ids.max_back
        sk, hkv = k.shape[1], k.shape[2]
        if h % hkv:
            raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
        self.b, self.sq, self.sk, self.h, self.hkv, self.d, self.g, self.tile = b, sq, sk, h, hkv, d, h // hkv, tile
        self.acc, self.rows = _acc_dtype(q.dtype), self.g * tile
        self.nq, self.nk = _tiles(sq, tile), _tiles(sk, tile)
        sq_pad, sk_pad = self.nq * tile, self.nk * tile
        self.q_doc = _padded(ids.q_doc.to(torch.int64), sq_pad, _Q_PAD_DOC)
        self.k_doc = _padded(ids.k_doc.to(torch.int64), sk_pad, _K_PAD_DOC)
        self.q_pos = _padded(ids.q_pos.to(torch.int64).expand(b, sq), sq_pad, _Q_PAD_POS)
        self.k_pos = _padded(ids.k_pos.to(torch.int64).expand(b, sk), sk_pad, _K_PAD_POS)
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

    def chunks(
        self, *, scale: float, pairs_per_chunk: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor]]:
        """The visible tile pairs, at most ``pairs_per_chunk`` at a time (default ``CHUNK_ELEMENTS`` scores per
        head): ``(qi, ki, lo, hi, scores)`` with every qi in ``[lo, hi)`` and the chunk's scores (``scores``).
        Pairs are sorted by query tile, so a chunk touches one contiguous range of query tiles; the range comes
        from one host copy of the pairs, not a device sync per chunk."""
        pairs = self.pairs()
        size = pairs_per_chunk or max(1, CHUNK_ELEMENTS // (self.tile * self.tile))
        host = pairs[:, 0].cpu()
        for start in range(0, pairs.shape[0], size):
            stop = min(start + size, pairs.shape[0])
            qi, ki = pairs[start:stop, 0], pairs[start:stop, 1]
            yield qi, ki, int(host[start]), int(host[stop - 1]) + 1, self.scores(qi, ki, scale=scale, dtype=self.acc)

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


def tiled_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ids: PackedIds,
    *,
    scale: float,
    tile: int | None = None,
    pairs_per_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's forward in plain torch: ``(out [B, Sq, h, d], lse [B, h, Sq])``, both in fp32 (or wider, for fp64
    inputs): the online softmax accumulates at that precision; the op casts ``out`` to q's dtype.

    A query row with no visible key (possible in a ring step) gets out 0 and lse -inf.
    """
    t = _Tiled(q, k, v, ids, tile=tile)
    acc, rows = t.acc, t.rows
    m_run = torch.full((t.b * t.nq, t.hkv, rows), float("-inf"), dtype=acc, device=q.device)
    l_run = torch.zeros_like(m_run)
    o_run = torch.zeros((t.b * t.nq, t.hkv, rows, t.d), dtype=acc, device=q.device)
    for qi, ki, lo, hi, scores in t.chunks(scale=scale, pairs_per_chunk=pairs_per_chunk):
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
    out: torch.Tensor,
    lse: torch.Tensor,
    ids: PackedIds,
    *,
    scale: float,
    tile: int | None = None,
    pairs_per_chunk: int | None = None,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the forward, recomputing each chunk's scores from the saved log-sum-exp.

    ``grad_lse`` (the ring merge differentiates through the log-sum-exp): d lse / d s = softmax, so it adds
    ``probs * grad_lse`` to d scores.
    """
    t = _Tiled(q, k, v, ids, tile=tile)
    acc, rows = t.acc, t.rows
    do = t.tile_queries(grad_out.to(acc))
    o = t.tile_queries(out.to(acc))
    lse_t = t.tile_queries(lse.transpose(1, 2).unsqueeze(-1).to(acc)).squeeze(-1)  # [NQ, hkv, rows]
    delta = (do * o).sum(-1)
    if grad_lse is not None:
        delta = delta - t.tile_queries(grad_lse.transpose(1, 2).unsqueeze(-1).to(acc)).squeeze(-1)
    lse_safe = torch.where(torch.isfinite(lse_t), lse_t, torch.full_like(lse_t, float("inf")))
    dq = torch.zeros((t.b * t.nq, t.hkv, rows, t.d), dtype=acc, device=q.device)
    dk = torch.zeros((t.b * t.nk, t.hkv, t.tile, t.d), dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    qa, ka, va = t.q.to(acc), t.k.to(acc), t.v.to(acc)
    for qi, ki, _, _, scores in t.chunks(scale=scale, pairs_per_chunk=pairs_per_chunk):
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
