"""Router, dispatcher and grouped experts against naive per-token references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nemo_ac.config.schema import MoEConfig
from nemo_ac.models.kernels.dispatch import LocalDispatcher, inverse_permutation, sort_by_expert, weighted_combine
from nemo_ac.models.layers.experts import GroupedExperts
from nemo_ac.models.layers.moe import MoE
from nemo_ac.models.layers.router import TopKRouter
from tests.factories import peak_bytes, saved_bytes

H, E, INTER = 24, 5, 12


def _experts(activation: str = "silu", impl: str = "loop") -> GroupedExperts:
    experts = GroupedExperts(E, H, INTER, activation=activation, impl=impl)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return experts


def _naive_expert(experts: GroupedExperts, x: torch.Tensor, e: int) -> torch.Tensor:
    h = x @ experts.gate_up_proj[e].T
    if experts.activation == "silu":
        h = F.silu(h[..., :INTER]) * h[..., INTER:]
    else:
        h = F.relu(h) ** 2
    return h @ experts.down_proj[e].T


# Uneven routing: expert 3 gets nothing, expert 0 gets most.
TOP_IDX = torch.tensor([[0, 1], [0, 2], [4, 0], [1, 0], [0, 4], [2, 1], [0, 1]])


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_dispatch_combine_matches_per_token_loop(activation: str) -> None:
    experts = _experts(activation)
    t, k = TOP_IDX.shape
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(t, H, generator=gen)
    scores = torch.rand(t, k, generator=gen)
    dispatcher = LocalDispatcher()
    rows, counts, ctx = dispatcher.dispatch(hidden, TOP_IDX, E)
    assert counts.tolist() == [6, 4, 2, 0, 2]
    out = dispatcher.combine(experts(rows, counts), scores, ctx)
    ref = torch.stack(
        [sum(scores[i, j] * _naive_expert(experts, hidden[i], int(TOP_IDX[i, j])) for j in range(k)) for i in range(t)]
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_zero_token_expert_gets_zero_grad_and_permutation_helpers() -> None:
    experts = _experts()
    hidden = torch.randn(TOP_IDX.shape[0], H)
    rows, counts, ctx = LocalDispatcher().dispatch(hidden, TOP_IDX, E)
    LocalDispatcher().combine(experts(rows, counts), torch.ones(TOP_IDX.shape), ctx).sum().backward()
    assert torch.all(experts.gate_up_proj.grad[3] == 0) and experts.gate_up_proj.grad[0].abs().sum() > 0
    order, _ = sort_by_expert(TOP_IDX, E)
    flat = TOP_IDX.reshape(-1)
    assert torch.all(flat[order][1:] >= flat[order][:-1])
    assert torch.equal(order[inverse_permutation(order)], torch.arange(order.numel()))


def test_grouped_mm_matches_loop() -> None:
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    loop, grouped = _experts(impl="loop"), _experts(impl="grouped_mm")
    x = torch.randn(14, H)
    counts = torch.tensor([6, 4, 2, 0, 2])
    grad = torch.randn(14, H)
    loop(x, counts).backward(grad)
    try:
        out = grouped(x, counts)
    except RuntimeError as err:  # pragma: no cover - depends on the build's CPU kernels
        pytest.skip(f"torch._grouped_mm unsupported here: {err}")
    out.backward(grad)
    torch.testing.assert_close(out, loop(x, counts))
    torch.testing.assert_close(grouped.gate_up_proj.grad, loop.gate_up_proj.grad)


def test_router_softmax_topk_and_normalization() -> None:
    router = TopKRouter(H, E, 2, score_func="softmax", norm_topk_prob=True)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(9, H)
    top_scores, top_idx, probs = router(x)
    ref_probs = torch.softmax(x @ router.weight.T, dim=-1)
    torch.testing.assert_close(probs, ref_probs)
    ref_vals, ref_idx = ref_probs.topk(2, dim=-1)
    assert torch.equal(top_idx, ref_idx)
    torch.testing.assert_close(top_scores, ref_vals / ref_vals.sum(-1, keepdim=True))
    torch.testing.assert_close(top_scores.sum(-1), torch.ones(9))
    unnormalized = TopKRouter(H, E, 2, norm_topk_prob=False)
    unnormalized.load_state_dict(router.state_dict())
    torch.testing.assert_close(unnormalized(x)[0], ref_vals)


def test_fp32_router_with_bf16_input() -> None:
    router = TopKRouter(H, E, 2, router_dtype="float32")
    torch.nn.init.normal_(router.weight, std=0.5)
    assert router.keep_fp32
    x = torch.randn(9, H).to(torch.bfloat16).requires_grad_()
    top_scores, top_idx, probs = router(x)
    assert top_scores.dtype == torch.float32 and probs.dtype == torch.float32 and top_idx.dtype == torch.int64
    torch.testing.assert_close(probs, torch.softmax(x.float() @ router.weight.T, dim=-1))
    top_scores.sum().backward()
    assert router.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_sigmoid_router_bias_selects_but_does_not_weight_and_groups_restrict() -> None:
    router = TopKRouter(
        H, 8, 2, score_func="sigmoid", n_group=4, topk_group=1, score_correction_bias=True, routed_scaling_factor=2.5
    )
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.zero_()
    router.e_score_correction_bias[6] = 100.0  # expert 6 always chosen, so group 3 (experts 6, 7) is the only group
    x = torch.randn(9, H)
    top_scores, top_idx, probs = router(x)
    assert sorted(set(top_idx.flatten().tolist())) == [6, 7]
    scores = torch.sigmoid(x @ router.weight.T)
    picked = scores.gather(1, top_idx)
    torch.testing.assert_close(top_scores, 2.5 * picked / picked.sum(-1, keepdim=True))
    torch.testing.assert_close(probs.sum(-1), torch.ones(9))
    assert "e_score_correction_bias" in router.state_dict()


def test_moe_stats_and_shared_expert() -> None:
    cfg = MoEConfig(
        num_experts=E, num_experts_per_tok=2, moe_intermediate_size=INTER, shared_expert_intermediate_size=16,
        shared_expert_gate=True,
    )  # fmt: skip
    moe = MoE(H, cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 5, H)
    out, stats = moe(x)
    assert out.shape == x.shape
    flat = x.reshape(-1, H)
    top_scores, top_idx, probs = moe.gate(flat)
    routed = torch.stack(
        [
            sum(top_scores[i, j] * _naive_expert(moe.experts, flat[i], int(top_idx[i, j])) for j in range(2))
            for i in range(10)
        ]
    )
    shared = torch.sigmoid(moe.shared_expert_gate(flat)) * moe.shared_expert(flat)
    torch.testing.assert_close(out.reshape(-1, H), routed + shared, atol=1e-5, rtol=1e-5)
    assert stats.num_tokens == 10
    assert stats.tokens_per_expert.dtype == torch.float32 and not stats.tokens_per_expert.requires_grad
    assert stats.tokens_per_expert.sum().item() == 20
    torch.testing.assert_close(stats.prob_sum, probs.sum(0))
    assert stats.prob_sum.requires_grad
    assert {n for n, _ in moe.named_children()} == {"gate", "experts", "shared_expert", "shared_expert_gate"}


def test_weighted_combine_gradients_and_keeps_rows_in_their_dtype() -> None:
    """The combine's own backward equals autograd's through the same fp32 math, and with bf16 rows it keeps the bf16
    rows and the scores for backward: autograd's fp32 product kept the fp32 upcast of the rows (2x their bytes)."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(256, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    scores = torch.rand(128, 2, generator=gen, requires_grad=True)
    ref_rows, ref_scores = rows.detach().requires_grad_(), scores.detach().requires_grad_()
    out = weighted_combine(rows, scores)
    ref = (ref_rows.view(128, 2, -1).to(torch.float32) * ref_scores.unsqueeze(-1)).sum(dim=1).to(torch.bfloat16)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(rows.grad, ref_rows.grad, rtol=0, atol=0)
    torch.testing.assert_close(scores.grad, ref_scores.grad, rtol=1e-6, atol=1e-6)
    assert saved_bytes(weighted_combine, rows, scores) <= rows.nbytes + scores.nbytes


def test_weighted_combine_fp32_temporaries_stay_below_the_rows_bytes() -> None:
    """Forward + backward of the combine on bf16 rows allocates its bf16 output and the rows' bf16 gradient, and
    fp32 temporaries of at most the rows' bytes (one token chunk's). Unchunked, the backward's fp32 [T, H] gradient
    and products took 3x the rows' bytes and set Qwen3.6's bf16 MoE FFN row's peak at 1.04x transformers'."""
    t, k, h = 256, 2, 128
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(t * k, h, generator=gen).to(torch.bfloat16).requires_grad_()
    scores = torch.rand(t, k, generator=gen, requires_grad=True)
    grad = torch.randn(t, h, generator=gen).to(torch.bfloat16)

    def step() -> None:
        weighted_combine(rows, scores).backward(grad)

    peak = peak_bytes(step)
    needed = rows.nbytes + grad.nbytes + scores.nbytes  # d rows, the output, d scores
    assert peak - needed <= rows.nbytes, (peak, needed, rows.nbytes)


def test_fp32_router_keeps_its_bf16_input_for_backward() -> None:
    """``router_dtype: float32`` on bf16 hidden states: the same gradients as the fp32 linear autograd ran, and the
    router keeps the bf16 input for backward, not an fp32 copy of it (2x its bytes)."""
    router = TopKRouter(H, E, 2, router_dtype="float32")
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(6))
    x = torch.randn(32, H, dtype=torch.bfloat16, requires_grad=True)
    logits = router.logits(x)
    ref_x = x.detach().requires_grad_()
    ref_w = router.weight.detach().clone().requires_grad_()
    ref = F.linear(ref_x.to(torch.float32), ref_w)
    grad = torch.randn_like(ref)
    logits.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(logits, ref, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)
    torch.testing.assert_close(router.weight.grad, ref_w.grad, rtol=1e-6, atol=1e-6)
    assert saved_bytes(router.logits, x) <= x.nbytes + router.weight.nbytes
