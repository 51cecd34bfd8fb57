"""What ``nemo_ac::packed_attention`` must compute, counted by its visible (query, key) pairs: the FLOP formulas
``packed_attention`` registers for FlopCounterMode (and the profiler, ``nemo-ac plan``), whichever kernel runs the
pairs (dense document spans or tiles), and the exact pair count they rest on.

Kept apart from the op so the count never depends on how the op computes: a kernel that computes a masked tile or a
whole causal block still counts only the pairs the mask lets attend. ``PackedIds`` (the ids and window of one call,
what decides which pairs are visible) lives here too: both kernels and the op's Python side take it whole.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

UNBOUNDED = 2**62  # max_back without a bound
_POS_SPAN = 2**41  # > any position (the op's own key padding is 2**40); doc * span + pos orders by (doc, pos)


@dataclasses.dataclass(frozen=True)
class PackedIds:
    """What decides which (query, key) pairs of one ``packed_attention`` call are visible: document ids ``q_doc``
    [B, Sq] / ``k_doc`` [B, Sk] (-1 = padding), global positions ``q_pos`` / ``k_pos`` ([Sq] / [Sk] or per row) and
    the window (``min_k_pos <= k_pos``, ``q_pos - k_pos < max_back``). The op's schema stays flat (a custom op takes
    tensors and scalars); its Python side, the dense spans and the tiled loop pass this one value instead of six
    arguments each."""

    q_doc: torch.Tensor
    k_doc: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    min_k_pos: int = 0
    max_back: int = UNBOUNDED


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
