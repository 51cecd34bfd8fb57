"""``nemo_ac::bf16x3_linear``: an fp32 router's GEMM as three bf16 GEMMs (``models.kernels.bf16x3_linear``).

Accuracy is measured against float64: the split must be as close as the fp32 GEMM it replaces (same products, fp32
accumulation), where one bf16 GEMM of the rounded weight (what ``router_dtype: param`` computes) is hundreds of
times further off; so a split that dropped a piece fails. The router's choice of experts is the fp32 path's.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nemo_ac.distributed.plan.kernels import Chosen, choose_router_gemm
from nemo_ac.models.kernels.bf16x3_linear import bf16_pieces, bf16x3_linear
from nemo_ac.models.layers.router import TopKRouter

T, H, E = 96, 256, 40


def operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=gen) * 2).to(torch.bfloat16)
    # Rows of different scales: the pieces must follow each row's magnitude.
    weight = torch.randn(E, H, generator=gen) * torch.logspace(-3, 1, E).unsqueeze(1)
    return x, weight


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def test_the_pieces_sum_to_the_fp32_weight() -> None:
    _, weight = operands()
    pieces = bf16_pieces(weight)
    assert [p.dtype for p in pieces] == [torch.bfloat16] * 3
    total = pieces[2].float() + pieces[1].float() + pieces[0].float()
    assert float((total - weight).abs().max() / weight.abs().max()) < 2**-23
    assert float((pieces[0].float() - weight).abs().max() / weight.abs().max()) > 2**-12  # one piece is not enough


def test_forward_is_as_accurate_as_the_fp32_gemm() -> None:
    x, weight = operands()
    exact = x.double() @ weight.double().t()
    split = relative_error(bf16x3_linear(x, weight), exact)
    fp32 = relative_error(x.float() @ weight.t(), exact)
    one_bf16 = relative_error((x @ weight.to(torch.bfloat16).t()).float(), exact)
    assert split <= 2 * fp32 + 1e-9, (split, fp32)
    assert one_bf16 > 100 * max(split, 1e-9), (one_bf16, split)


def test_backward_is_as_accurate_as_the_fp32_gemms() -> None:
    x, weight = operands(1)
    grad = torch.randn(T, E, generator=torch.Generator().manual_seed(2))
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    bf16x3_linear(xs, ws).backward(grad)
    want_w = grad.double().t() @ x.double()
    want_x = grad.double() @ weight.double()
    assert ws.grad.dtype == torch.float32 and xs.grad.dtype == torch.bfloat16
    fp32_w = relative_error(grad.t() @ x.float(), want_w)
    assert relative_error(ws.grad, want_w) <= 2 * fp32_w + 1e-9
    # The input's gradient is bf16: as close as the fp32 path's rounding of the same sum.
    fp32_x = (grad @ weight).to(torch.bfloat16)
    assert relative_error(xs.grad, want_x) <= 1.1 * relative_error(fp32_x, want_x)


def test_flop_counter_counts_three_gemms_forward_and_six_backward() -> None:
    x, weight = operands()
    w = weight.clone().requires_grad_()
    xs = x.clone().requires_grad_()
    one_gemm = 2 * T * H * E
    with FlopCounterMode(display=False) as counter:
        out = torch.ops.nemo_ac.bf16x3_linear(xs, w)
    assert counter.get_total_flops() == 3 * one_gemm
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert counter.get_total_flops() == 6 * one_gemm


def router(fp32_gemm: str) -> TopKRouter:
    gate = TopKRouter(H, E, 4, score_func="sigmoid", router_dtype="float32", fp32_gemm=fp32_gemm)
    with torch.no_grad():
        gate.weight.copy_(operands()[1])
    return gate


def test_the_router_chooses_the_fp32_paths_experts() -> None:
    x, _ = operands(3)
    scores, idx, probs = router("float32")(x)
    split_scores, split_idx, split_probs = router("bf16x3")(x)
    assert torch.equal(idx, split_idx)
    torch.testing.assert_close(split_scores, scores, rtol=1e-4, atol=1e-6)  # fp32 sums in another order
    torch.testing.assert_close(split_probs, probs, rtol=1e-4, atol=1e-6)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_calls_the_op_as_one_node_in_one_graph() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    gate = router("bf16x3")
    x, _ = operands(4)
    compiled = torch.compile(gate.logits, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), gate.logits(x), rtol=0, atol=0)
    compiled(operands(5)[0])
    assert len(graphs) == 1
    targets = [str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count("nemo_ac.bf16x3_linear") == 1, targets


def test_auto_splits_on_cuda_with_bf16_compute_only() -> None:
    auto = {
        (router_dtype, device, dtype): choose_router_gemm(
            "auto", router_dtype=router_dtype, device_type=device, param_dtype=dtype
        )
        for router_dtype in ("float32", "param")
        for device in ("cuda", "cpu")
        for dtype in ("bfloat16", "float32")
    }
    assert auto[("float32", "cuda", "bfloat16")] == Chosen("bf16x3", "auto: cuda bfloat16")
    assert auto[("float32", "cpu", "bfloat16")] == Chosen("float32", "auto: cpu bfloat16")
    assert auto[("float32", "cuda", "float32")] == Chosen("float32", "auto: cuda float32")
    assert {auto[key].value for key in auto if key[0] == "param"} == {"param"}
    assert choose_router_gemm("float32", router_dtype="float32", device_type="cuda", param_dtype="bfloat16") == Chosen(
        "float32"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tensor-core path needs CUDA; runs in gpu_check.sh")
def test_cuda_tensor_cores_give_the_cpu_products() -> None:
    x, weight = operands()
    exact = x.double() @ weight.double().t()
    on_gpu = bf16x3_linear(x.cuda(), weight.cuda()).cpu()
    assert relative_error(on_gpu, exact) <= 2 * relative_error(x.float() @ weight.t(), exact) + 1e-9
    torch.testing.assert_close(on_gpu, bf16x3_linear(x, weight), rtol=1e-6, atol=1e-6)
