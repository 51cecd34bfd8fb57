"""The packed-document attention op (``backend.attention: tiled``), both of its kernels (dense document spans on
SDPA's fused CPU kernel, the tiled loop): exact against the dense SDPA reference, no [S, S] tensor, work bounded by
the visible pairs, one op to torch.compile and to selective AC."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from nemo_ac.distributed.activation_checkpointing import make_selective_checkpoint_context_fn
from nemo_ac.models.kernels import packed_attention as tiled
from nemo_ac.models.kernels.flex_attention import flex_attention_available, flex_packed_attention
from nemo_ac.models.kernels.packed_attention import (
    DENSE_SPANS,
    TILE_AUTO,
    PackedIds,
    packed_attention,
    visible_tile_pairs,
)
from nemo_ac.models.kernels.packed_attention_spans import plan_spans
from nemo_ac.models.layers.attention import (
    build_attention_inputs,
    flex_packed_attention_op,
    packed_causal_attention,
    tiled_packed_attention,
)
from tests.factories import emulated_ring, emulated_ring_qkv, ring_docs, ring_reference, saved_bytes


def _row(lengths: list[int], pad: int = 0) -> torch.Tensor:
    return torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * pad)


CASES = {
    # two rows: short documents + padding, and one long document (rows start at position 0)
    "short_docs_and_padding": torch.stack((_row([3, 17, 1, 30, 20], pad=9), _row([80]))),
    "one_long_document": _row([80]).unsqueeze(0),
    "many_short_documents": _row([5] * 16).unsqueeze(0),
}


def ring_qkv(b: int, s: int, *, dtype: torch.dtype, nh: int = 4, nkv: int = 2, hd: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(b, s, n, hd, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for n in (nh, nkv, nkv)
    )


def _grads(out: torch.Tensor, inputs, seed: int = 1):
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("tile", [16, 64, 7, DENSE_SPANS], ids=["tile16", "tile64", "tile7", "spans"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_equals_the_dense_reference_outputs_and_gradients(case, tile, dtype, tol, monkeypatch):
    """GQA (4 query heads over 2 K/V heads), padding, tiles that do not divide S; the dense spans (one block per
    document, padding as equal-position pairs)."""
    monkeypatch.setattr(tiled, "DEFAULT_TILE", tile)
    docs = CASES[case]
    q, k, v = ring_qkv(docs.shape[0], docs.shape[1], dtype=dtype)
    attn = build_attention_inputs(docs)
    ref = packed_causal_attention(q, k, v, attn)
    got = tiled_packed_attention(q, k, v, attn)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    for g, w in zip(_grads(got, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("tile", [16, DENSE_SPANS], ids=["tile16", "spans"])
def test_rows_starting_mid_document_and_the_log_sum_exp_gradient(tile):
    """Queries from the middle of a document against keys that start earlier (a ring step's shape), and a loss on
    the log-sum-exp as the ring merge has one: equal to the dense softmax over the same visible pairs. (The spans'
    backward hands this case, lse gradients with dO = 0, to the tiled loop; the next test has both.)"""
    docs = _row([20, 40, 20]).unsqueeze(0)
    q, k, v = ring_qkv(1, 80, dtype=torch.float64)
    qs, ks = slice(30, 70), slice(10, 50)  # queries 30..69 see keys 10..49 of their documents
    pos = torch.arange(80)
    out, lse = packed_attention(
        q[:, qs], k[:, ks], v[:, ks], q_doc=docs[:, qs], k_doc=docs[:, ks], q_pos=pos[qs], k_pos=pos[ks], tile=tile
    )
    kk, vv = (t[:, ks].repeat_interleave(2, 2).transpose(1, 2) for t in (k, v))
    scores = q[:, qs].transpose(1, 2) @ kk.transpose(-1, -2) * 8**-0.5
    same = (docs[0, qs, None] == docs[0, None, ks]) & (pos[ks][None, :] <= pos[qs][:, None])
    scores = scores.masked_fill(~same, float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    ref_out = torch.nan_to_num(torch.softmax(scores, -1)) @ vv
    rows = torch.isfinite(ref_lse)
    assert not rows.all()  # some queries (the first document's) see nothing among these keys
    torch.testing.assert_close(lse[rows], ref_lse[rows], rtol=1e-12, atol=1e-12)
    assert torch.isinf(lse[~rows]).all() and (out.transpose(1, 2)[~rows] == 0).all()
    torch.testing.assert_close(out.transpose(1, 2)[rows], ref_out[rows], rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(ref_lse).masked_fill(~rows, 0)
    got = torch.autograd.grad((lse.masked_fill(~rows, 0) * weights).sum(), (q, k, v))
    want = torch.autograd.grad((ref_lse.masked_fill(~rows, 0) * weights).sum(), (q, k))  # lse needs no v
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert (got[2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_spans_equal_tiles_with_output_and_log_sum_exp_gradients(dtype):
    """A ring step's shape (two query runs, a key block before them and a causal one, a document the keys do not
    hold) with a loss on both outputs: the spans' backward folds grad_lse into the kernel's D and matches the tiled
    loop."""
    docs = _row([20, 40, 20]).unsqueeze(0)
    q, k, v = ring_qkv(1, 80, dtype=dtype)
    qs, ks = slice(30, 70), slice(10, 50)
    pos = torch.arange(80)
    ids = {"q_doc": docs[:, qs], "k_doc": docs[:, ks], "q_pos": pos[qs], "k_pos": pos[ks]}
    plan = plan_spans(PackedIds(**ids))
    assert [(b.causal, b.k1 - b.k0) for b in plan.blocks] == [(False, 10), (True, 20)]
    results = []
    for tile in (DENSE_SPANS, 16):
        out, lse = packed_attention(q[:, qs], k[:, ks], v[:, ks], tile=tile, **ids)
        finite = torch.isfinite(lse)
        w_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
        w_lse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(3), dtype=lse.dtype)
        loss = (out * w_out).sum() + (lse.masked_fill(~finite, 0) * w_lse).sum()
        results.append((out, lse.masked_fill(~finite, 0), *torch.autograd.grad(loss, (q, k, v))))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_the_kernel_choice_follows_the_ids(monkeypatch):
    """TILE_AUTO: dense spans for long documents, the tiled loop for short ones and where blocks cannot say the
    mask (a window that cuts a document, positions out of order); a positive tile forces the tiled loop."""
    q = torch.zeros(1, 256, 2, 8)
    pos = torch.arange(256)

    def plan(docs, tile=TILE_AUTO, *, q_pos=pos, max_back=256):
        return tiled.span_plan(
            q, PackedIds(q_doc=docs, k_doc=docs, q_pos=q_pos, k_pos=q_pos, max_back=max_back), tile=tile
        )

    long_docs = _row([100, 156]).unsqueeze(0)
    assert [(b.q0, b.q1, b.causal) for b in plan(long_docs).blocks] == [(0, 100, True), (100, 256, True)]
    assert plan(long_docs, tile=32) is None
    assert plan(long_docs, max_back=150) is None  # the window cuts the 156-token document
    assert plan(long_docs, q_pos=pos.flip(0)) is None
    short_docs = _row([8] * 32).unsqueeze(0)
    assert plan(short_docs) is None and len(plan(short_docs, tile=DENSE_SPANS).blocks) == 32
    padded = _row([100, 100], pad=56).unsqueeze(0)
    assert plan(padded).self_q.tolist() == list(range(200, 256))  # padding attends itself


@pytest.mark.parametrize("cp_size", [2, 4])
def test_the_ring_on_dense_spans_equals_the_reference(cp_size, monkeypatch):
    """Every ring step through the spans (head-tail chunks, keys before the queries, a block with nothing
    visible, padding), forward and backward through the log-sum-exp merge."""
    monkeypatch.setattr(tiled, "SPAN_MIN_RUN", 1)
    s = 8 * cp_size + 8 * cp_size // 2
    docs = ring_docs(s)
    q, k, v = emulated_ring_qkv(2, s, seed=cp_size)
    ring = emulated_ring(q, k, v, docs, cp_size=cp_size, kernel="tiled")
    ref = ring_reference(q, k, v, docs)
    torch.testing.assert_close(ring, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(ref)
    for got, want in zip(
        torch.autograd.grad(ring, (q, k, v), grad, retain_graph=True), torch.autograd.grad(ref, (q, k, v), grad)
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("docs", [[2048], [512] * 4], ids=["one_document", "mean_512"])
def test_bf16_spans_match_the_fp32_reference(docs):
    """bf16 through the fused kernel: outputs and gradients within bf16 round-off of the fp32 dense reference
    (relative to the norm, at most twice the error of SDPA's own bf16 with the dense mask)."""
    row = _row(docs).unsqueeze(0)
    q, k, v = ring_qkv(1, row.shape[1], dtype=torch.float32, hd=64)
    attn = build_attention_inputs(row)
    ref = packed_causal_attention(q, k, v, attn)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    want = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))

    def errors(op) -> list[float]:
        out = op(qb, kb, vb, attn)
        got = (out, *torch.autograd.grad(out, (qb, kb, vb), grad.bfloat16()))
        return [float((g.detach().float() - w.detach()).norm() / w.detach().norm()) for g, w in zip(got, want)]

    for err, sdpa_err in zip(errors(tiled_packed_attention), errors(packed_causal_attention)):
        assert err <= min(2 * sdpa_err, 1e-2), (err, sdpa_err)


@pytest.mark.parametrize("docs", [[256], [64] * 4], ids=["one_document", "mean_64"])
@pytest.mark.parametrize("tile", [TILE_AUTO, 32], ids=["auto", "tiles"])
def test_bf16_out_leaves_in_q_dtype_and_is_saved_once(docs, tile):
    """The op returns ``out`` in q's dtype and ``lse`` in fp32, and the local path keeps nothing else of ``out``:
    saved for backward are q, k, v, ``out`` in bf16, the fp32 ``lse`` and the ids. With an fp32 ``out`` the local
    path saved it at twice the size and cast it four times around the op (one bf16 document at 2k: 1.22x SDPA)."""
    row = _row(docs).unsqueeze(0)
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in ring_qkv(1, row.shape[1], dtype=torch.float32, hd=16))
    positions = torch.arange(row.shape[1])
    out, lse = packed_attention(q, k, v, q_doc=row, k_doc=row, q_pos=positions, k_pos=positions, tile=tile)
    assert (out.dtype, lse.dtype) == (torch.bfloat16, torch.float32)
    attn = build_attention_inputs(row)
    ids = row.numel() * row.element_size() + positions.numel() * positions.element_size()
    bound = sum(t.numel() * 2 for t in (q, k, v, out)) + lse.numel() * 4 + ids
    assert saved_bytes(tiled_packed_attention, q, k, v, attn) <= bound


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("lengths", [[512] * 4, [2048]], ids=["mean_512", "one_document"])
def test_no_tensor_grows_with_s_squared(lengths):
    s = 2048
    docs = _row(lengths).unsqueeze(0)
    q, k, v = ring_qkv(1, s, dtype=torch.float32, nh=2, nkv=1, hd=16)
    ids = PackedIds(q_doc=docs, k_doc=docs, q_pos=torch.arange(s), k_pos=torch.arange(s))
    with _LargestTensor() as mode:
        out, lse = tiled.tiled_attention_forward(q, k, v, ids, scale=0.25)
        tiled.tiled_attention_backward(torch.ones_like(out), q, k, v, out, lse, ids, scale=0.25)
    assert mode.largest < s * s // 4, mode.largest  # forward and backward
    with _LargestTensor() as spans:  # the op's own choice: dense spans (the fused kernel tiles internally)
        out, _ = packed_attention(q, k, v, q_doc=docs, k_doc=docs, q_pos=ids.q_pos, k_pos=ids.k_pos, max_back=s)
        out.sum().backward()
    assert 0 < spans.largest < s * s // 4, spans.largest
    with _LargestTensor() as dense:
        packed_causal_attention(q, k, v, build_attention_inputs(docs))
    assert dense.largest >= s * s  # the reference builds [B, 1, S, S] (and SDPA's CPU path the scores)


@pytest.mark.parametrize(("lengths", "bound"), [([512] * 8, 1.3), ([4096], 1.05)])
def test_computed_tiles_follow_the_visible_pairs(lengths, bound):
    docs = _row(lengths).unsqueeze(0)
    s, tile = docs.shape[1], tiled.choose_tile(max(lengths))
    pos = torch.arange(s).unsqueeze(0)
    pairs = visible_tile_pairs(docs, docs, pos, pos, tile=tile).shape[0]
    visible = sum(n * (n + 1) // 2 for n in lengths)
    assert visible <= pairs * tile * tile <= bound * visible, pairs * tile * tile / visible
    # The window (the longest document) bounds the work as well: a too-small max_back drops visible tiles.
    assert visible_tile_pairs(docs, docs, pos, pos, tile=tile, max_back=tile).shape[0] < pairs or len(lengths) == 1


def test_one_compiled_graph_across_document_layouts(fresh_dynamo):
    """fullgraph: the op is one opaque node; new layouts (documents, max_seqlen) never recompile."""
    from nemo_ac.workarounds.dynamic_per_batch_ints import dynamic_source_patterns

    def attend(q, k, v, attn):
        return tiled_packed_attention(q, k, v, attn)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    q, k, v = ring_qkv(2, 88, dtype=torch.float32)
    with torch.compiler.config.patch(dynamic_sources=dynamic_source_patterns()):
        for lengths in ([30, 58], [10, 20, 58], [88], [5, 5, 78]):
            attn = build_attention_inputs(_row(lengths).expand(2, 88).contiguous())
            out = compiled(q, k, v, attn)
            torch.testing.assert_close(out, packed_causal_attention(q, k, v, attn), rtol=1e-5, atol=1e-5)
            out.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"] and not counters["recompiles"]


@pytest.mark.skipif(not flex_attention_available(), reason="this torch has no FlexAttention")
def test_flex_compiles_once_across_windows_eager_and_inside_a_compiled_block(fresh_dynamo):
    """The window's ints (the longest document, ring CP's first key) change every micro batch. In flex's mask they
    were closure ints: compiled flex guarded on them and recompiled per micro batch on an H200
    (``block_mask.mask_mod.__closure__[2].cell_contents == 76``); eager flex's own compile did too (two graphs for
    four windows here), and inside a compiled block ``warnings.catch_warnings`` graph-broke (fullgraph fails)."""
    from nemo_ac.workarounds.dynamic_per_batch_ints import dynamic_source_patterns

    q, k, v = (t.detach() for t in ring_qkv(2, 88, dtype=torch.float32))
    layouts = ([30, 58], [10, 20, 58], [88], [5, 5, 78])
    for lengths in layouts:  # eager: flex's own compile (backend eager) of its higher-order op
        attn = build_attention_inputs(_row(lengths).expand(2, 88).contiguous())
        torch.testing.assert_close(flex_packed_attention_op(q, k, v, attn), tiled_packed_attention(q, k, v, attn))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(flex_packed_attention_op, backend="eager", fullgraph=True)
    with torch.compiler.config.patch(dynamic_sources=dynamic_source_patterns()):
        for lengths in layouts:
            attn = build_attention_inputs(_row(lengths).expand(2, 88).contiguous())
            torch.testing.assert_close(compiled(q, k, v, attn), tiled_packed_attention(q, k, v, attn))
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"] and not counters["recompiles"]


def test_selective_ac_saves_the_op_whole_and_the_recompute_never_reruns_it(monkeypatch, private_sac_ignored_ops):
    calls = []
    forward = tiled.packed_attention_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiled, "packed_attention_forward", counting)
    docs = _row([30, 50]).unsqueeze(0)
    q, k, v = ring_qkv(1, 80, dtype=torch.float32)
    attn = build_attention_inputs(docs)

    def region(q, k, v):
        return (tiled_packed_attention(q, k, v, attn) * 2).sigmoid()

    out = checkpoint(region, q, k, v, use_reentrant=False, context_fn=make_selective_checkpoint_context_fn())
    got = torch.autograd.grad(out.sum(), (q, k, v))
    assert len(calls) == 1  # forward only: the recompute replays the saved (out, lse)
    want = torch.autograd.grad(region(q, k, v).sum(), (q, k, v))
    assert len(calls) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.skipif(not flex_attention_available(), reason="this torch has no FlexAttention")
@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_forward_equals_the_reference_on_cpu(case):
    """FlexAttention's forward runs (unfused) on CPU: same outputs and log-sum-exp as the tiled op; its backward
    needs CUDA (benchmarks/gpu_check.sh runs it there)."""
    docs = CASES[case]
    q, k, v = (t.detach() for t in ring_qkv(docs.shape[0], docs.shape[1], dtype=torch.float32))
    pos = torch.arange(docs.shape[1])
    ids = {"q_doc": docs, "k_doc": docs, "q_pos": pos, "k_pos": pos}
    out, lse = flex_packed_attention(q, k, v, **ids)
    ref_out, ref_lse = packed_attention(q, k, v, **ids)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not flex_attention_available(), reason="this torch has no FlexAttention")
def test_flex_under_counting_modes_runs_as_the_tiled_op_and_is_counted():
    """Under a dispatch mode that stops Dynamo (torch's FlopCounterMode, nemo_ac's StepCounter) FlexAttention cannot
    run (on an H200: ``no implementation found for 'torch.ops.higher_order.flex_attention'`` and ``no rule
    registered for HigherOrderOperator flex_attention``): the tiled op stands in, with the same values, gradients and
    FLOPs. Without the stand-in both modes raise here on CPU as they did on the GPU."""
    from torch.utils.flop_counter import FlopCounterMode

    from nemo_ac.simulate.counters import StepCounter

    docs = CASES[sorted(CASES)[0]]
    pos = torch.arange(docs.shape[1])
    ids = {"q_doc": docs, "k_doc": docs, "q_pos": pos, "k_pos": pos}

    def run(op, mode, *, backward):
        q, k, v = (t.detach().requires_grad_(backward) for t in ring_qkv(*docs.shape, dtype=torch.float32))
        with mode:
            out, lse = op(q, k, v, **ids)
            if backward:
                out.sum().backward()
        return (out, lse, q.grad, k.grad, v.grad) if backward else (out, lse)

    for make_mode, total in ((lambda: FlopCounterMode(display=False), lambda m: m.get_total_flops()),
                             (StepCounter, lambda m: sum(m.counts.flops.values()))):  # fmt: skip
        for backward in (False, True):  # the forward alone is what failed on the GPU (CPU flex has no backward)
            flex_mode, tiled_mode = make_mode(), make_mode()
            got = run(flex_packed_attention, flex_mode, backward=backward)
            want = run(packed_attention, tiled_mode, backward=backward)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert total(flex_mode) == total(tiled_mode) > 0


def test_a_ring_block_with_nothing_visible_computes_nothing():
    """Keys that all lie after the queries (a ring step's block from a later chunk), or in other documents: no
    tile is computed (0 FLOPs), every row is empty (out 0, lse -inf) and merges with zero weight."""
    from torch.utils.flop_counter import FlopCounterMode

    docs = _row([64, 64]).unsqueeze(0)
    q, k, v = (t.detach() for t in ring_qkv(1, 128, dtype=torch.float32))
    pos = torch.arange(128)
    for keys in (slice(64, 128), slice(0, 64)):  # later positions; earlier positions of another document
        queries = slice(0, 64) if keys.start == 64 else slice(64, 128)
        with FlopCounterMode(display=False) as flops:
            ids = PackedIds(q_doc=docs[:, queries], k_doc=docs[:, keys], q_pos=pos[queries], k_pos=pos[keys])
            out, lse = tiled.tiled_attention_forward(q[:, queries], k[:, keys], v[:, keys], ids, scale=0.125)
        assert flops.get_total_flops() == 0
        assert (out == 0).all() and torch.isinf(lse).all()
