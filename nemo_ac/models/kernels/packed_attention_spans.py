"""Packed-document attention as dense document spans handed to SDPA's fused CPU kernel.

Where every document of a packed row is a run of consecutive positions (what the data path produces: the local
row, the Ulysses inner op's full row, each ring step's head and tail chunks), the visible pairs of one (query run,
key run) of the same document are at most two dense blocks: the keys before the first query (every query sees all
of them) and the keys from the first query on (a causal diagonal block, top-left aligned). Each block is one call
of torch's fused flash kernel for CPU, ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, which
computes every pair once, in tiles, with an online softmax and no [S, S] tensor, GQA included (query head i uses
K/V head i // g, as ``repeat_interleave`` does), and returns the log-sum-exp; its backward op recomputes each tile
once from that log-sum-exp (flash-style). Partial results of the blocks of one query run are merged with their
log-sum-exps (as the ring merges steps); equal-position pairs outside every block (padding attends itself) are one
key per query, merged the same way.

The plain-torch tiled loop (``packed_attention``'s ``tiled_attention_forward``) gathers the q / k / v tiles of
every visible tile pair (profiled, one document at 4k: the gathers and their copies were 32% of self time against
40% for the matmuls) and runs small matmuls of 32 x 32 x 64; this path hands whole documents to one kernel.

The backward passes each block the merged (global) output and log-sum-exp, so the kernel's P = exp(S - lse) and
D = rowsum(dO * O) are those of the whole softmax: the blocks' gradients sum to the exact gradient. The ring merge
also differentiates through the log-sum-exp (``grad_lse``): d lse / d s = P adds ``P * grad_lse`` to dS =
P * (dP - D), i.e. D becomes D - grad_lse. The kernel computes D from the ``out`` it is given, so each query row's
``out`` is passed with its element at the largest |dO| lowered by grad_lse / dO there (exact in real arithmetic,
rounding like D itself); a row with grad_lse but dO = 0 has no such element and the call returns None (the caller
runs the tiled backward instead).

``plan_spans`` returns None wherever the blocks cannot say the exact mask (positions not increasing, a window
``max_back`` that cuts a document): the caller then runs the tiled loop.
"""

from __future__ import annotations

import dataclasses

import torch

from nemo_ac.models.kernels.packed_attention_flops import PackedIds

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclasses.dataclass(frozen=True)
class Block:
    """Queries ``[q0, q1)`` of row ``row`` against keys ``[k0, k1)``: all pairs, or ``causal`` top-left (query
    ``q0 + i`` sees key ``k0 + j`` iff ``j <= i``)."""

    row: int
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@dataclasses.dataclass(frozen=True)
class SpanPlan:
    """The dense blocks of one call and its equal-position pairs outside them (``self_q`` / ``self_k``: flat
    ``row * S + index`` of the query and its key)."""

    blocks: tuple[Block, ...]
    self_q: torch.Tensor
    self_k: torch.Tensor
    query_runs: int

    def mean_query_run(self, queries: int) -> float:
        return queries / max(self.query_runs, 1)

    def whole(self, sq: int, sk: int) -> Block | None:
        """The one block, when it is the whole call (one row, one document, nothing else): the kernel's results
        are the op's, with no accumulator and no copy (one-document rows)."""
        if len(self.blocks) != 1 or self.self_q.numel():
            return None
        blk = self.blocks[0]
        return blk if (blk.q0, blk.q1, blk.k0, blk.k1) == (0, sq, 0, sk) else None


def _runs(doc: torch.Tensor, pos: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """``(doc, first index, end index, first position)`` of each maximal run of one document id (>= 0) over
    consecutive positions, from a row's host ids (a few small host copies, no Python loop over positions)."""
    cut = torch.ones(doc.shape[0] + 1, dtype=torch.bool)
    cut[1:-1] = (doc[1:] != doc[:-1]) | (pos[1:] != pos[:-1] + 1)
    edges = cut.nonzero().squeeze(-1)
    starts, ends = edges[:-1], edges[1:]
    keep = doc[starts] >= 0
    starts, ends = starts[keep], ends[keep]
    return list(zip(doc[starts].tolist(), starts.tolist(), ends.tolist(), pos[starts].tolist(), strict=True))


def _row_blocks(
    row: int,
    q_runs: list[tuple[int, int, int, int]],
    k_runs: list[tuple[int, int, int, int]],
    *,
    min_k_pos: int,
    max_back: int,
) -> list[Block] | None:
    by_doc: dict[int, list[tuple[int, int, int, int]]] = {}
    for run in k_runs:
        by_doc.setdefault(run[0], []).append(run)
    blocks = []
    for doc, qi0, qi1, a in q_runs:
        q_end = a + (qi1 - qi0)  # one past the last query position
        for _, ki0, ki1, c in by_doc.get(doc, ()):
            k_end = c + (ki1 - ki0)
            lo = max(c, min_k_pos)
            before_end = min(k_end, a)  # keys before every query: all pairs visible
            if lo < before_end:
                if (q_end - 1) - lo >= max_back:
                    return None  # the window cuts the block: not a dense block
                blocks.append(Block(row, qi0, qi1, ki0 + lo - c, ki0 + before_end - c, causal=False))
            d0, d1 = max(lo, a), min(k_end, q_end)  # keys from the first query on: causal, top-left
            if d0 < d1:
                if (q_end - 1) - d0 >= max_back:
                    return None
                blocks.append(Block(row, qi0 + d0 - a, qi1, ki0 + d0 - c, ki0 + d1 - c, causal=True))
    return blocks


def plan_spans(ids: PackedIds) -> SpanPlan | None:
    """The dense blocks of ``packed_attention``'s exact mask (same document, causal, ``min_k_pos`` and ``max_back``;
    or equal positions), or None where blocks cannot express it. One host copy of the ids."""
    q_doc, k_doc, q_pos, k_pos = ids.q_doc, ids.k_doc, ids.q_pos, ids.k_pos
    min_k_pos, max_back = ids.min_k_pos, ids.max_back
    b, sq = q_doc.shape
    sk = k_doc.shape[1]
    if max_back < 1:
        return None
    qd, kd = q_doc.to(torch.int64).cpu(), k_doc.to(torch.int64).cpu()
    qp = q_pos.to(torch.int64).cpu().expand(b, sq)
    kp = k_pos.to(torch.int64).cpu().expand(b, sk)
    if sq > 1 and not bool((qp[:, 1:] > qp[:, :-1]).all()):
        return None
    if sk > 1 and not bool((kp[:, 1:] > kp[:, :-1]).all()):
        return None
    blocks: list[Block] = []
    query_runs = 0
    for row in range(b):
        q_runs = _runs(qd[row], qp[row])
        k_runs = _runs(kd[row], kp[row])
        row_blocks = _row_blocks(row, q_runs, k_runs, min_k_pos=min_k_pos, max_back=max_back)
        if row_blocks is None:
            return None
        blocks += row_blocks
        query_runs += len(q_runs)
    # Equal positions (at most one key per query: positions increase) that no block holds: padding attends
    # itself, and so does any query whose own position the window or its document excludes.
    j = _equal_position_keys(qp, kp)
    k_at = kp.gather(1, j)
    same_pos = k_at == qp
    in_block = (qd == kd.gather(1, j)) & (qd >= 0) & (qp >= min_k_pos)
    rows, cols = (same_pos & ~in_block).nonzero(as_tuple=True)
    self_q = (rows * sq + cols).to(q_doc.device)
    self_k = (rows * sk + j[rows, cols]).to(q_doc.device)
    return SpanPlan(tuple(blocks), self_q, self_k, query_runs)


def _equal_position_keys(qp: torch.Tensor, kp: torch.Tensor) -> torch.Tensor:
    """[B, Sq] index of the key at each query's position (or its neighbour, where none is): the diagonal when
    queries and keys share their positions (the local path, the Ulysses inner op), else a search of the increasing
    key positions (ring steps). The shortcut matters under load: torch's CPU ``searchsorted`` opens a parallel region
    that waits for a free core, 6-9 ms a call on a busy 2-core machine (two calls a step) for a 0.5 ms search."""
    sq, sk = qp.shape[1], kp.shape[1]
    if sq == sk and torch.equal(qp, kp):
        return torch.arange(sq).expand_as(qp)
    return torch.searchsorted(kp.contiguous(), qp.contiguous()).clamp(max=sk - 1)


def _heads_first(x: torch.Tensor, row: int, lo: int, hi: int) -> torch.Tensor:
    """[B, S, h, d] -> the [1, h, hi - lo, d] view of row ``row`` (the kernel takes strided inputs)."""
    return x[row : row + 1, lo:hi].transpose(1, 2)


def _merge_into(out: torch.Tensor, lse: torch.Tensor, o_new: torch.Tensor, lse_new: torch.Tensor) -> None:
    """Fold a partial ``(o_new [.., S, h, d], lse_new [.., h, S])`` into ``(out, lse)`` in place (log-sum-exp)."""
    total = torch.logaddexp(lse, lse_new)
    finite = torch.isfinite(total)
    safe = torch.where(finite, total, torch.zeros_like(total))
    w_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(total)).transpose(-1, -2).unsqueeze(-1)
    w_new = torch.where(finite, torch.exp(lse_new - safe), torch.zeros_like(total)).transpose(-1, -2).unsqueeze(-1)
    out.copy_(out * w_old + o_new * w_new)
    lse.copy_(total)


def _self_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SpanPlan, *, scale: float, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per equal-position pair: the query rows [n, h, d], their key's K and V repeated to the query heads."""
    h, hkv = q.shape[2], k.shape[2]
    qs = q.flatten(0, 1)[plan.self_q].to(acc)
    ks = k.flatten(0, 1)[plan.self_k].to(acc).repeat_interleave(h // hkv, dim=1)
    vs = v.flatten(0, 1)[plan.self_k].to(acc).repeat_interleave(h // hkv, dim=1)
    return qs, ks, vs


class _Coverage:
    """Which positions of each row kernel results have written (host bytes, one per position): the first write
    copies, later ones add or merge, positions never written get their empty value once at the end. Accumulators are
    ``torch.empty``: no zero-fill pass before the adds (a fresh zero-filled accumulator per call cost more than the
    kernel on 512-token documents at 2k, profiled: ``fill_`` and ``add_`` 50% of self time)."""

    def __init__(self, rows: int, length: int) -> None:
        self.marks = [bytearray(length) for _ in range(rows)]

    def gaps(self, row: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """The unwritten ranges within [lo, hi)."""
        marks, found, i = self.marks[row], [], lo
        while i < hi:
            start = marks.find(0, i, hi)
            if start < 0:
                break
            end = marks.find(1, start, hi)
            end = hi if end < 0 else end
            found.append((start, end))
            i = end
        return found

    def fresh(self, row: int, lo: int, hi: int) -> bool:
        return self.marks[row].find(1, lo, hi) < 0

    def mark(self, row: int, lo: int, hi: int) -> None:
        self.marks[row][lo:hi] = b"\x01" * (hi - lo)


def _write(cover: _Coverage, row: int, lo: int, hi: int, *pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``dst[row, lo:hi] (+)= value`` along dim 1 for each ``(dst, value)``: copied where nothing was written yet,
    added elsewhere (unwritten positions zeroed first)."""
    gaps = None if cover.fresh(row, lo, hi) else cover.gaps(row, lo, hi)
    for dst, value in pairs:
        if gaps is None:
            dst[row : row + 1, lo:hi].copy_(value)
            continue
        for a, b in gaps:
            dst[row : row + 1, a:b].zero_()
        dst[row : row + 1, lo:hi].add_(value)
    cover.mark(row, lo, hi)


def _fill_gaps(cover: _Coverage, dst: torch.Tensor, value: float, *, dim: int) -> None:
    for row, marks in enumerate(cover.marks):
        for a, b in cover.gaps(row, 0, len(marks)):
            dst[row].narrow(dim - 1, a, b - a).fill_(value)


def spans_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SpanPlan, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Sq, h, d] in q's dtype, lse [B, h, Sq] in fp32, fp64 for fp64 inputs)``; rows without a visible
    key: 0, -inf. Several blocks of one query run merge in fp32; a whole-call block returns the kernel's results
    as they are (no cast, no copy)."""
    b, sq, h, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    whole = plan.whole(sq, k.shape[1]) if b == 1 else None
    if whole is not None:
        o, whole_lse = _FLASH(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, whole.causal, scale=scale)
        return o.transpose(1, 2), whole_lse.to(acc).contiguous()
    out = torch.empty((b, sq, h, d), dtype=acc, device=q.device)
    lse = torch.empty((b, h, sq), dtype=acc, device=q.device)
    cover = _Coverage(b, sq)
    for blk in plan.blocks:
        o, block_lse = _FLASH(
            _heads_first(q, blk.row, blk.q0, blk.q1),
            _heads_first(k, blk.row, blk.k0, blk.k1),
            _heads_first(v, blk.row, blk.k0, blk.k1),
            0.0,
            blk.causal,
            scale=scale,
        )
        o = o.transpose(1, 2)  # [1, L, h, d]
        dst_o, dst_l = out[blk.row : blk.row + 1, blk.q0 : blk.q1], lse[blk.row : blk.row + 1, :, blk.q0 : blk.q1]
        if cover.fresh(blk.row, blk.q0, blk.q1):
            dst_o.copy_(o)  # the one write (and cast) of a run's first block
            dst_l.copy_(block_lse)
        else:  # another block of the same queries: merge (positions not yet written start empty)
            for a, c in cover.gaps(blk.row, blk.q0, blk.q1):
                out[blk.row : blk.row + 1, a:c].zero_()
                lse[blk.row : blk.row + 1, :, a:c].fill_(float("-inf"))
            _merge_into(dst_o, dst_l, o.to(acc), block_lse.to(acc))
        cover.mark(blk.row, blk.q0, blk.q1)
    _fill_gaps(cover, out, 0.0, dim=1)  # rows without a visible key: out 0, lse -inf
    _fill_gaps(cover, lse, float("-inf"), dim=2)
    if plan.self_q.numel():
        qs, ks, vs = _self_terms(q, k, v, plan, scale=scale, acc=acc)
        s = (qs * ks).sum(-1) * scale  # [n, h]
        flat_out, flat_lse = out.flatten(0, 1), lse.transpose(1, 2).flatten(0, 1)  # [B*Sq, h, d], [B*Sq, h]
        o_cur, l_cur = flat_out[plan.self_q], flat_lse[plan.self_q]
        _merge_into(o_cur, l_cur.transpose(0, 1), vs, s.transpose(0, 1))
        flat_out[plan.self_q] = o_cur
        lse.copy_(flat_lse.index_put((plan.self_q,), l_cur).view(b, sq, h).transpose(1, 2))
    return out.to(q.dtype), lse


def _lowered_out(out: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor) -> torch.Tensor | None:
    """``out`` with rowsum(dO * out) lowered by grad_lse (see the module docstring), or None if a row with
    grad_lse has dO = 0."""
    g = grad_lse.transpose(1, 2).unsqueeze(-1)  # [B, S, h, 1]
    idx = grad_out.abs().argmax(-1, keepdim=True)
    pivot = grad_out.gather(-1, idx)
    needed = g != 0
    if bool((needed & (pivot == 0)).any()):
        return None
    shift = torch.where(needed, g / torch.where(pivot == 0, torch.ones_like(pivot), pivot), torch.zeros_like(g))
    return out.scatter(-1, idx, out.gather(-1, idx) - shift)


def spans_backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: SpanPlan,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """dq, dk, dv of ``spans_forward`` (None: see ``_lowered_out``)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    kernel_out = out
    if grad_lse is not None and bool((grad_lse != 0).any()):
        lowered = _lowered_out(out.to(acc), grad_out.to(acc), grad_lse.to(acc))
        if lowered is None:
            return None
        kernel_out = lowered
    # The kernel takes one dtype; dO and out arrive in q's (the op's contract): no cast without a grad_lse.
    do_k, out_k = grad_out.to(q.dtype), kernel_out.to(q.dtype)
    whole = plan.whole(q.shape[1], k.shape[1]) if q.shape[0] == 1 else None
    if whole is not None:
        grads = _FLASH_BACKWARD(
            *(x.transpose(1, 2) for x in (do_k, q, k, v, out_k)), lse.to(acc), 0.0, whole.causal, scale=scale
        )
        return tuple(g.transpose(1, 2) for g in grads)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.empty(k.shape, dtype=acc, device=q.device)
    dv = torch.empty(v.shape, dtype=acc, device=q.device)
    q_cover, k_cover = _Coverage(q.shape[0], q.shape[1]), _Coverage(k.shape[0], k.shape[1])
    for blk in plan.blocks:
        r, q0, q1, k0, k1 = blk.row, blk.q0, blk.q1, blk.k0, blk.k1
        gq, gk, gv = _FLASH_BACKWARD(
            _heads_first(do_k, r, q0, q1),
            _heads_first(q, r, q0, q1),
            _heads_first(k, r, k0, k1),
            _heads_first(v, r, k0, k1),
            _heads_first(out_k, r, q0, q1),
            lse[r : r + 1, :, q0:q1].to(acc).contiguous(),
            0.0,
            blk.causal,
            scale=scale,
        )
        _write(q_cover, r, q0, q1, (dq, gq.transpose(1, 2)))
        _write(k_cover, r, k0, k1, (dk, gk.transpose(1, 2)), (dv, gv.transpose(1, 2)))
    _fill_gaps(q_cover, dq, 0.0, dim=1)
    _fill_gaps(k_cover, dk, 0.0, dim=1)
    _fill_gaps(k_cover, dv, 0.0, dim=1)
    if plan.self_q.numel():
        _self_backward(grad_out.to(acc), grad_lse, q, k, v, out.to(acc), lse.to(acc), plan, scale, dq, dk, dv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _self_backward(grad_out, grad_lse, q, k, v, out, lse, plan, scale, dq, dk, dv) -> None:
    """The equal-position pairs' share: P = exp(s - lse), dV += P dO, dS = P (dO . v - D + grad_lse)."""
    h, hkv = q.shape[2], k.shape[2]
    g = h // hkv
    acc = dq.dtype
    qs, ks, vs = _self_terms(q, k, v, plan, scale=scale, acc=acc)
    lse_rows = lse.transpose(1, 2).flatten(0, 1)[plan.self_q]  # [n, h]
    do = grad_out.flatten(0, 1)[plan.self_q]  # [n, h, d]
    p = torch.exp((qs * ks).sum(-1) * scale - lse_rows)
    delta = (do * out.flatten(0, 1)[plan.self_q]).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(acc).transpose(1, 2).flatten(0, 1)[plan.self_q]
    ds = p * ((do * vs).sum(-1) - delta) * scale  # [n, h]
    n = plan.self_q.shape[0]
    dq.view(-1, h, q.shape[3]).index_add_(0, plan.self_q, ds.unsqueeze(-1) * ks)
    dk.view(-1, hkv, k.shape[3]).index_add_(0, plan.self_k, (ds.unsqueeze(-1) * qs).view(n, hkv, g, -1).sum(2))
    dv.view(-1, hkv, v.shape[3]).index_add_(0, plan.self_k, (p.unsqueeze(-1) * do).view(n, hkv, g, -1).sum(2))
