"""Gated DeltaNet: chunked rule vs a token-by-token recurrence, document resets, and the head-separable op contract."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nemo_ac.config.schema import LinearAttentionConfig
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    document_starts,
    l2norm,
    packed_causal_conv1d,
)
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.models.layers.gated_deltanet import GatedDeltaNet
from tests.factories import saved_bytes


def recurrent_reference(q, k, v, g, beta, document_ids):
    """Token-by-token gated delta rule (the definition), restarting the state at every document start."""
    b, s, h, dk = q.shape
    q = q.float() * dk**-0.5
    state = torch.zeros(b, h, dk, v.shape[-1])
    out = torch.zeros(b, s, h, v.shape[-1])
    starts = document_starts(document_ids)
    for t in range(s):
        keep = (~starts[:, t]).float()[:, None, None, None]
        state = state * keep * g[:, t].exp()[..., None, None]
        kt, vt = k[:, t].float(), v[:, t].float()
        delta = (vt - torch.einsum("bhkv,bhk->bhv", state, kt)) * beta[:, t, :, None]
        state = state + kt[..., None] * delta[..., None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out


def _random_inputs(b=2, s=45, h=3, dk=8, dv=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(b, s, h, dk, generator=gen))
    k = l2norm(torch.randn(b, s, h, dk, generator=gen))
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -2 * torch.rand(b, s, h, generator=gen)
    beta = torch.rand(b, s, h, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_chunked_rule_matches_recurrence_with_document_resets(chunk_size: int) -> None:
    q, k, v, g, beta = _random_inputs()
    # Row 0: boundaries inside chunks and on a chunk edge; row 1: one document, then padding (-1) at the end.
    docs = torch.zeros(2, 45, dtype=torch.long)
    docs[0, 7:16], docs[0, 16:17], docs[0, 17:] = 1, 2, 3
    docs[1, 40:] = -1
    out = chunk_gated_delta_rule(q, k, v, g, beta, doc_starts=document_starts(docs), chunk_size=chunk_size)
    ref = recurrent_reference(q, k, v, g, beta, docs)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_packed_causal_conv_never_reads_another_document() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 19, 2, 3, generator=gen)
    w = torch.randn(2, 3, 4, generator=gen)
    docs = torch.tensor([[0] * 6 + [1] * 2 + [2] * 11])
    out = packed_causal_conv1d(x, w, docs)
    pieces = []
    for lo, hi in ((0, 6), (6, 8), (8, 19)):
        seg = x[:, lo:hi].flatten(2).transpose(1, 2)  # [1, C, L]
        conv = F.conv1d(seg, w.reshape(6, 1, 4), padding=3, groups=6)[..., : hi - lo]
        pieces.append(F.silu(conv).transpose(1, 2).reshape(1, hi - lo, 2, 3))
    torch.testing.assert_close(out, torch.cat(pieces, dim=1), atol=1e-6, rtol=1e-5)


def _layer(chunk_size: int = 8) -> GatedDeltaNet:
    cfg = LinearAttentionConfig(
        num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, conv_kernel=4, chunk_size=chunk_size
    )
    with torch.device("meta"):
        layer = GatedDeltaNet(24, cfg)
    return materialize_and_init(layer, device="cpu", seed=2, init_std=0.2, family="qwen3_5_moe")


def test_two_packed_documents_equal_each_alone_with_gradients() -> None:
    layer = _layer()
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(1, 13, 24, generator=gen), torch.randn(1, 22, 24, generator=gen)
    packed = torch.cat((a, b), dim=1).requires_grad_(True)
    docs = torch.cat((torch.zeros(1, 13), torch.ones(1, 22)), dim=1).long()
    out = layer(packed, attn=build_attention_inputs(docs))
    alone_a = layer(a, attn=build_attention_inputs(torch.zeros(1, 13, dtype=torch.long)))
    alone_b = layer(b, attn=build_attention_inputs(torch.zeros(1, 22, dtype=torch.long)))
    torch.testing.assert_close(out, torch.cat((alone_a, alone_b), dim=1), atol=1e-5, rtol=1e-4)
    out[:, 13:].sum().backward()  # the second document's loss must not reach the first document's inputs
    assert packed.grad is not None and torch.isfinite(packed.grad).all()
    assert packed.grad[:, :13].abs().max() == 0 and packed.grad[:, 13:].abs().max() > 0
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


def test_op_is_swappable_and_head_separable() -> None:
    """What Ulysses CP relies on: the op sees [B, S, heads, .] tensors and runs per head group with sliced conv
    weights (value head i reads key head i // (Hv / Hk))."""
    layer = _layer()
    x = torch.randn(2, 17, 24, generator=torch.Generator().manual_seed(4))
    attn = build_attention_inputs(torch.tensor([[0] * 9 + [1] * 8, [0] * 17]))
    full_op = layer.linear_attn_op
    expected = layer(x, attn=attn)
    seen: list[tuple[int, ...]] = []

    def split_heads(q, k, v, g, beta, conv, attn_inputs):
        seen.extend([tuple(q.shape), tuple(v.shape), tuple(g.shape)])
        outs = []
        for rank in range(2):  # two "ranks", each with one key head and the two value heads that read it
            ks, vs = slice(rank, rank + 1), slice(2 * rank, 2 * rank + 2)
            local_conv = (conv[0][ks], conv[1][ks], conv[2][vs])
            outs.append(
                full_op(q[:, :, ks], k[:, :, ks], v[:, :, vs], g[:, :, vs], beta[:, :, vs], local_conv, attn_inputs)
            )
        return torch.cat(outs, dim=2)

    layer.linear_attn_op = split_heads
    torch.testing.assert_close(layer(x, attn=attn), expected, atol=1e-6, rtol=1e-5)
    assert seen == [(2, 17, 2, 8), (2, 17, 4, 6), (2, 17, 4)]


def test_init_hooks() -> None:
    layer = _layer()
    a = layer.A_log.exp()
    assert torch.all((a >= 0.01) & (a <= 16)) and a.std() > 0
    assert torch.all(layer.dt_bias == 1) and torch.all(layer.norm.weight == 1)


@pytest.mark.slow
def test_compiles_fullgraph_with_backward_and_no_recompile_for_new_document_layouts() -> None:
    """No graph break, no data-dependent specialization on document boundaries, and the backward runs (the
    F.softplus stride issue of torch 2.13 AOT autograd is avoided)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = _layer()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 19, 24, generator=torch.Generator().manual_seed(6), requires_grad=True)
    for docs in ([[0] * 9 + [1] * 10, [0] * 19], [[0] * 3 + [1] * 16, [0] * 15 + [-1] * 4]):
        attn = build_attention_inputs(torch.tensor(docs))
        out = compiled(x, attn=attn)
        torch.testing.assert_close(out, layer(x, attn=attn), atol=1e-6, rtol=1e-5)
        out.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1


def test_packed_causal_conv_backward_matches_autograd_and_keeps_only_its_input() -> None:
    """The conv's own backward equals autograd's through the same math (fp64 gradcheck, packed documents), and it
    keeps x, the weight and the ids for backward: the autograd form kept a padded copy, one masked copy per earlier
    tap and the pre-SiLU output (5 input-sized tensors for 4 taps)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 11, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    docs = torch.tensor([[0] * 4 + [1] + [2] * 6, [5] * 11])
    torch.autograd.gradcheck(lambda a, b: packed_causal_conv1d(a, b, docs), (x, w))
    big = torch.randn(1, 512, 4, 32, requires_grad=True)
    weight = torch.randn(4, 32, 4, requires_grad=True)
    ids = torch.zeros(1, 512, dtype=torch.long)
    saved = saved_bytes(packed_causal_conv1d, big, weight, ids)
    assert saved <= big.nbytes + weight.nbytes + ids.nbytes, saved / big.nbytes


def test_chunked_rule_keeps_no_more_for_backward_than_transformers() -> None:
    """q, k, v reach the chunked rule as [B, S, H, d] (already fp32 after the L2 norm): made contiguous in
    [B, H, S, d] once, the chunk matmuls save views of them. On the transposed views each matmul saved its own
    contiguous copy (k^T twice, q, k * beta): 1.03x transformers' ``torch_chunk_gated_delta_rule`` here, and
    32 MiB above it on the Qwen3.6 flagship row (4096 tokens, bf16)."""
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    b, s, h, d, c = 1, 256, 2, 64, 32
    q, k, v, g, beta = _random_inputs(b=b, s=s, h=h, dk=d, dv=d)
    q, k, v, g, beta = (t.requires_grad_() for t in (q, k, v, g, beta))
    saved = saved_bytes(lambda *a: chunk_gated_delta_rule(*a, chunk_size=c), q, k, v, g, beta)
    reference = saved_bytes(lambda *a: modeling.torch_chunk_gated_delta_rule(*a, chunk_size=c), q, k, v, g, beta)
    assert saved <= reference, saved / reference
