"""Packed-document attention, rope and attention metadata."""

from __future__ import annotations

import pytest
import torch

from nemo_ac.config.schema import ModelConfig, MoEConfig
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import (
    Attention,
    build_attention_inputs,
    document_causal_mask,
    packed_causal_attention,
)
from nemo_ac.models.layers.rope import RotaryEmbedding, apply_rotary


def _tiny_model() -> torch.nn.Module:
    cfg = ModelConfig(init_std=0.1, moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))
    return materialize_and_init(build_model(cfg), device="cpu", seed=3).eval()


def test_two_packed_documents_match_each_document_alone() -> None:
    model = _tiny_model()
    gen = torch.Generator().manual_seed(1)
    lens = (7, 10)
    docs = [torch.randint(0, 128, (n,), generator=gen) for n in lens]
    packed_ids = torch.cat(docs).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(packed_ids, position_ids=position_ids, attn=build_attention_inputs(document_ids)).logits
        offset = 0
        for doc in docs:
            n = doc.numel()
            alone = model(
                doc.unsqueeze(0),
                position_ids=torch.arange(n).unsqueeze(0),
                attn=build_attention_inputs(torch.zeros(1, n, dtype=torch.long)),
            ).logits
            torch.testing.assert_close(packed[:, offset : offset + n], alone, atol=1e-5, rtol=1e-5)
            offset += n


def test_mask_is_causal_within_documents_and_padding_attends_to_itself() -> None:
    doc = torch.tensor([[0, 0, 1, 1, 1, -1, -1]])
    mask = document_causal_mask(doc)[0, 0]
    assert mask.shape == (7, 7)
    assert mask[1, 0] and not mask[0, 1]  # causal
    assert not mask[2, 1] and mask[4, 2]  # no attention across documents
    assert mask[5].tolist() == [False] * 5 + [True, False]  # padding sees only itself
    assert mask[6].tolist() == [False] * 6 + [True]
    assert mask.any(dim=-1).all()


def test_padding_rows_are_finite_and_gqa_matches_repeated_heads() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 8, generator=gen)
    k = torch.randn(2, 9, 2, 8, generator=gen)
    v = torch.randn(2, 9, 2, 8, generator=gen)
    doc = torch.tensor([[0] * 5 + [1] * 2 + [-1] * 2, [0] * 9])
    attn = build_attention_inputs(doc)
    out = packed_causal_attention(q, k, v, attn)
    assert out.shape == q.shape and torch.isfinite(out).all()
    ref = packed_causal_attention(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), attn)
    torch.testing.assert_close(out, ref)


def test_build_attention_inputs_cu_seqlens() -> None:
    doc = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]])
    attn = build_attention_inputs(doc)
    assert attn.cu_seqlens.tolist() == [0, 3, 5, 6, 10]
    assert attn.cu_seqlens.dtype == torch.int32 and attn.document_ids.dtype == torch.int32
    assert attn.max_seqlen == 4 and isinstance(attn.max_seqlen, int)


def test_attn_op_is_swappable() -> None:
    layer = Attention(32, 4, 2, 8)
    calls = []

    def op(q, k, v, attn):
        calls.append((q.shape, k.shape))
        return packed_causal_attention(q, k, v, attn)

    layer.attn_op = op
    rope = RotaryEmbedding(8, 10000.0)(torch.arange(5).unsqueeze(0))
    out = layer(torch.randn(1, 5, 32), rope=rope, attn=build_attention_inputs(torch.zeros(1, 5, dtype=torch.long)))
    assert out.shape == (1, 5, 32)
    assert calls == [((1, 5, 4, 8), (1, 5, 2, 8))]
    assert "attn_op" not in dict(layer.named_modules())


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_rope_matches_transformers(factor: float) -> None:
    glm = pytest.importorskip("transformers.models.glm4_moe.modeling_glm4_moe", reason="transformers not importable")
    head_dim, theta = 16, 500.0
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 5]])
    rope = RotaryEmbedding(head_dim, theta, factor)
    cos, sin = rope(position_ids)
    dim = int(head_dim * factor)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = (inv[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    torch.testing.assert_close(cos, emb.cos(), rtol=0, atol=0)
    torch.testing.assert_close(sin, emb.sin(), rtol=0, atol=0)
    q = torch.randn(1, 6, 4, head_dim)
    k = torch.randn(1, 6, 2, head_dim)
    ours_q, ours_k = apply_rotary(q, k, cos, sin)
    # transformers works in [B, heads, S, hd] with unsqueeze_dim=1.
    ref_q, ref_k = glm.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch.testing.assert_close(ours_q, ref_q.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(ours_k, ref_k.transpose(1, 2), rtol=0, atol=0)
    if factor < 1.0:
        torch.testing.assert_close(ours_q[..., dim:], q[..., dim:], rtol=0, atol=0)
