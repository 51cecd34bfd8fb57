"""FLOP formulas of nemo_ac's custom ops: FlopCounterMode counts their work instead of 0, exactly as a reference.

Each formula is checked against an independent count: the grouped GEMMs against 2 * rows * K * N, packed attention's
visible pairs against the op's own dense mask, the fla / mamba-ssm ops against FlopCounterMode over nemo_ac's torch
reference of the same algorithm, and an op without a formula is named rather than counted as 0 silently.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nemo_ac.models.kernels import fla_gdn
from nemo_ac.models.kernels import mamba_ssm as mamba_ssm_kernel
from nemo_ac.models.kernels.gated_delta_rule import packed_gated_delta_rule
from nemo_ac.models.kernels.op_flops import ops_without_formula
from nemo_ac.models.kernels.packed_attention import UNBOUNDED, _pair_mask, packed_attention, visible_pairs
from nemo_ac.models.layers.experts import GroupedExperts
from nemo_ac.models.layers.mamba2 import Mamba2CoreParams, mamba2_ssm
from nemo_ac.simulate.counters import StepCounter


def _flops(fn) -> int:  # type: ignore[no-untyped-def]
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_count_their_grouped_gemms(dtype: torch.dtype) -> None:
    """Forward: 2 * rows * H * 2I (gate_up) + 2 * rows * I * H (down); backward twice that. Without nemo_ac's
    formulas torch 2.13 counts the grouped GEMMs as 0 (aten._grouped_mm has none)."""
    experts, hidden, inter, rows = 4, 32, 16, 24
    module = GroupedExperts(experts, hidden, inter, impl="grouped_mm").to(dtype)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(rows, hidden, dtype=dtype, requires_grad=True)
    counts = torch.tensor([5, 0, 11, 8])
    forward = 2 * rows * hidden * 2 * inter + 2 * rows * inter * hidden
    assert _flops(lambda: module(x, counts)) == forward
    assert _flops(lambda: module(x, counts).float().sum().backward()) == 3 * forward


def test_visible_pairs_equal_the_ops_exact_mask_on_random_layouts() -> None:
    generator = torch.Generator().manual_seed(0)
    for trial in range(120):
        rows, sq = 2, int(torch.randint(1, 40, (1,), generator=generator))
        sk = sq if trial % 2 else int(torch.randint(1, 40, (1,), generator=generator))
        q_doc = torch.randint(-1, 3, (rows, sq), generator=generator).sort(dim=1).values
        k_doc = torch.randint(-1, 3, (rows, sk), generator=generator).sort(dim=1).values
        q_pos = torch.randint(0, 20, (rows, sq), generator=generator)
        k_pos = torch.randint(0, 20, (rows, sk), generator=generator)
        min_k_pos = int(torch.randint(0, 5, (1,), generator=generator))
        max_back = [UNBOUNDED, 3, 1, 0][trial % 4]
        dense = int(_pair_mask(q_doc, k_doc, q_pos, k_pos, min_k_pos=min_k_pos, max_back=max_back).sum())
        assert visible_pairs(q_doc, k_doc, q_pos, k_pos, min_k_pos=min_k_pos, max_back=max_back) == dense


def test_packed_attention_counts_its_visible_pairs_forward_and_backward() -> None:
    """Two documents of 40 and 24 tokens in a 64-token row: 40*41/2 + 24*25/2 = 1120 visible pairs; forward
    2 * pairs * heads * (d + d), backward (torch's SDPA convention: 5 matmuls) 2 * pairs * heads * (3d + 2d)."""
    heads, kv_heads, d, s = 4, 2, 8, 64
    q = torch.randn(1, s, heads, d, requires_grad=True)
    k = torch.randn(1, s, kv_heads, d, requires_grad=True)
    v = torch.randn(1, s, kv_heads, d, requires_grad=True)
    docs = torch.tensor([[0] * 40 + [1] * 24])
    positions = torch.arange(s)
    pairs = 40 * 41 // 2 + 24 * 25 // 2

    def run() -> torch.Tensor:
        return packed_attention(q, k, v, q_doc=docs, k_doc=docs, q_pos=positions, k_pos=positions)[0]

    assert _flops(run) == 2 * pairs * heads * 2 * d
    assert _flops(lambda: run().sum().backward()) == 2 * pairs * heads * 2 * d + 2 * pairs * heads * 5 * d


def test_fla_op_formula_equals_the_torch_reference_of_the_same_algorithm() -> None:
    b, s, hk, hv, dk, dv = 1, 136, 2, 4, 8, 8
    shapes = ((b, s, hk, dk), (b, s, hk, dk), (b, s, hv, dv), (b, s, hv), (b, s, hv), (hk, dk, 4), (hk, dk, 4),
              (hv, dv, 4))  # fmt: skip
    tensors = [torch.randn(shape, requires_grad=True) for shape in shapes]
    attn = SimpleNamespace(document_ids=torch.zeros(b, s, dtype=torch.int64), context_parallel=None)

    def reference() -> torch.Tensor:
        return packed_gated_delta_rule(*tensors[:5], tuple(tensors[5:]), attn, chunk_size=64)  # type: ignore[arg-type]

    forward, both = _flops(reference), _flops(lambda: reference().sum().backward())
    assert forward > 0
    assert fla_gdn._fla_flops(*shapes, (b, s)) == forward
    assert fla_gdn._fla_backward_flops((b, s, hv, dv), *shapes, (b, s)) == both  # the re-run forward + backward


def test_mamba_op_formula_equals_the_torch_reference_of_the_same_algorithm() -> None:
    b, s, nh, hd, g, n, k = 1, 40, 4, 8, 1, 16, 4
    shapes = ((b, s, nh, hd), (b, s, g, n), (b, s, g, n), (b, s, nh), (nh, hd, k), (nh, hd), (g, n, k), (g, n),
              (g, n, k), (g, n), (nh,), (nh,), (nh,))  # fmt: skip
    t = [torch.randn(shape, requires_grad=True) for shape in shapes]
    params = Mamba2CoreParams(*t[4:13], chunk_size=16, dt_min=0.001, dt_max=float("inf"))
    attn = SimpleNamespace(document_ids=torch.zeros(b, s, dtype=torch.int64), context_parallel=None)
    forward = _flops(lambda: mamba2_ssm(t[0], t[1], t[2], t[3], params, attn))  # type: ignore[arg-type]
    both = _flops(lambda: mamba2_ssm(t[0], t[1], t[2], t[3], params, attn).sum().backward())  # type: ignore[arg-type]
    assert forward > 0
    args = (*shapes, (b, s), 16, 0.001, float("inf"))
    assert mamba_ssm_kernel._mamba_flops(*args) == forward
    assert mamba_ssm_kernel._mamba_backward_flops((b, s, nh, hd), list(shapes), (b, s), 16, 0.001, float("inf")) == both


@torch.library.custom_op("nemo_ac_test::no_formula", mutates_args=())
def _no_formula(x: torch.Tensor) -> torch.Tensor:
    return x @ x


@_no_formula.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_an_op_without_a_formula_is_named_never_counted_as_zero_silently() -> None:
    x = torch.randn(8, 8)
    with StepCounter() as counter:
        torch.mm(x, x)
        _no_formula(x)
    assert counter.counts.without_formula == {"nemo_ac_test.no_formula": 1}
    assert counter.counts.flops["forward"] == 2 * 8 * 8 * 8  # the mm only
    assert ops_without_formula([torch.ops.nemo_ac_test.no_formula.default, torch.ops.aten.mm.default]) == [
        "nemo_ac_test.no_formula"
    ]


def test_sdpa_on_cpu_counts_what_torchs_cuda_formula_counts() -> None:
    """``backend.attention: sdpa`` on CPU runs SDPA's fused CPU kernel, for which torch registers no formula: the dry
    run of a CUDA plan (a fake step on CPU) counted its attention as 0 FLOPs. It now counts torch's flash formula:
    4 * b * h * s_q * s_k * d forward (QK^T and PV), 2.5 times that backward (flash recomputes P). Nothing else in
    the op computes (repeat_interleave for GQA, the mask, transposes)."""
    from nemo_ac.models.layers.attention import build_attention_inputs, packed_causal_attention

    b, s, heads, kv_heads, d = 2, 48, 4, 2, 16
    q = torch.randn(b, s, heads, d, requires_grad=True)
    k, v = (torch.randn(b, s, kv_heads, d, requires_grad=True) for _ in range(2))
    attn = build_attention_inputs(torch.tensor([[0] * 20 + [1] * 28, [0] * 48]))
    forward = 4 * b * heads * s * s * d

    def step() -> None:
        packed_causal_attention(q, k, v, attn).sum().backward()

    assert _flops(step) == forward + int(2.5 * forward)
    with StepCounter() as counter:
        step()
    assert counter.counts.flops["forward"] + counter.counts.flops["backward"] == forward + int(2.5 * forward)
    assert counter.counts.without_formula == {}
