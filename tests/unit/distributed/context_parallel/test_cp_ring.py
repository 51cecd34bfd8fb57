"""Ring attention math in one process: the online-softmax merge and the whole head-tail ring against plain SDPA.

The ring's communication is exercised by tests/functional/test_ep_cp_ops.py; here every rank's K/V block is handed
to ``ring_block_update`` directly in ring order, which is exactly what the op does between two hops.
"""

from __future__ import annotations

import pytest
import torch

from nemo_ac.distributed.context_parallel.ring import (
    block_attention,
    block_mask,
    merge_partials,
)
from nemo_ac.distributed.context_parallel.sharding import (
    RingAttentionInputs,
    head_tail_positions,
    ring_attention_inputs,
    shard_positions,
)
from nemo_ac.models.layers.attention import document_causal_mask
from tests.factories import (
    RING_HD,
    emulated_ring,
    emulated_ring_qkv,
    ring_docs,
    ring_packed_docs,
    ring_reference,
)


def test_block_attention_merge_equals_sdpa_including_fully_masked_rows() -> None:
    """Keys split into three blocks (one where some query rows see nothing) merge to exactly SDPA."""
    s = 14
    docs = ring_packed_docs(s, [4, 6, 4]).unsqueeze(0)
    q, k, v = emulated_ring_qkv(1, s)
    mask = document_causal_mask(docs)  # [1, 1, S, S]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)))
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    bounds = [(0, 5), (5, 9), (9, 14)]
    out = lse = None
    for lo, hi in [bounds[1], bounds[0], bounds[2]]:  # any block order: the merge is commutative
        o, l_blk = block_attention(qh, kh[:, :, lo:hi], vh[:, :, lo:hi], mask[..., lo:hi], scale=RING_HD**-0.5)
        if lo == 9:
            assert torch.isinf(l_blk[0, 0, :9]).all() and (o[0, 0, :9] == 0).all()  # rows with no key in block
        # Rows 0..4 see nothing in the first block [5, 9): their lse is -inf until block [0, 5) is merged.
        out, lse = (o, l_blk) if out is None else merge_partials(out, lse, o, l_blk)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", ["sdpa", "tiled"])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_head_tail_ring_equals_full_packed_attention_forward_and_backward(cp_size: int, kernel: str) -> None:
    s = 8 * cp_size + 8 * cp_size // 2  # 24 or 48: chunks of 6; never a model dimension
    docs = ring_docs(s)
    q, k, v = emulated_ring_qkv(2, s, seed=cp_size)
    ring = emulated_ring(q, k, v, docs, cp_size=cp_size, kernel=kernel)
    ref = ring_reference(q, k, v, docs)
    torch.testing.assert_close(ring, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(ring, (q, k, v), grad, retain_graph=True)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "override",
    [{"local_k_slice": 10**6}, {"max_seqlen_q": 1}, {"max_seqlen_k": 1}],
    ids=["local_k_slice", "max_seqlen_q", "max_seqlen_k"],
)
@pytest.mark.parametrize("kernel", ["sdpa", "tiled"])
def test_per_micro_batch_ints_are_real_inputs(override: dict, kernel: str) -> None:
    """A wrong value of any ring int changes the output: the ints take part in the computation (which is why
    compile must keep them symbolic instead of ignoring them); the tiled kernel also skips work by them."""
    s = 24
    docs = ring_docs(s)
    q, k, v = emulated_ring_qkv(2, s, seed=7)
    right = emulated_ring(q, k, v, docs, cp_size=2, kernel=kernel)
    wrong = emulated_ring(q, k, v, docs, cp_size=2, meta_override=override, kernel=kernel)
    assert not torch.allclose(right, wrong)


def test_ring_ints_match_brute_force_definitions() -> None:
    s, cp_size = 24, 2
    docs = ring_docs(s)
    for rank in range(cp_size):
        meta = ring_attention_inputs(docs, cp_size=cp_size, cp_rank=rank)
        local = shard_positions(s, cp_size=cp_size, cp_rank=rank, cp_type="ring").tolist()
        extents = []  # per row: (start, length) of the document of every position, padding = own document
        for row in docs.tolist():
            spans, start = [], 0
            for p in range(1, s + 1):
                if p == s or row[p] != row[p - 1] or row[p] < 0:
                    spans += [(start, p - start)] * (p - start)
                    start = p
            extents.append(spans)
        assert meta.max_seqlen_q == max(extents[r][p][1] for r in range(2) for p in local)
        assert meta.max_seqlen_k == max(n for spans in extents for _, n in spans)
        assert meta.local_k_slice == min(extents[r][p][0] for r in range(2) for p in local)
        assert meta.document_ids.dtype == torch.int32 and meta.document_ids.shape == (2, s)


def test_block_mask_padding_attends_itself_only() -> None:
    meta = RingAttentionInputs(document_ids=torch.zeros(1, 4), max_seqlen_q=8, max_seqlen_k=8, local_k_slice=0)
    pos = torch.arange(4)
    docs = torch.tensor([[0, 0, -1, -1]])
    mask = block_mask(pos, pos, docs, docs, meta)[0, 0]
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],
        [False, False, False, True],
    ]


def test_head_tail_positions_balance_causal_work() -> None:
    """Rank i holds chunks i and 2cp-1-i; every rank has the same number of causal (query, key) pairs."""
    cp_size, chunk = 4, 3
    s = 2 * cp_size * chunk
    seen = []
    work = []
    for rank in range(cp_size):
        pos = head_tail_positions(chunk, cp_size=cp_size, cp_rank=rank)
        seen += pos.tolist()
        work.append(int((pos + 1).sum()))  # a query at position p attends p + 1 keys
    assert sorted(seen) == list(range(s))
    assert len(set(work)) == 1, work
