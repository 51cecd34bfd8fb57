"""The dry run's op counter (``nemo_ac.simulate.counters``): what it charges an op."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_ac.simulate.counters import StepCounter


def test_the_counter_counts_what_an_op_returning_nothing_writes() -> None:
    """``_fused_adamw_`` returns nothing: it reads parameters, gradients and both moments and writes what its schema
    marks written: the same four (the gradients for in-place unscaling; 32 bytes per fp32 parameter, an upper bound
    by 4 where no grad scaler runs). Counting outputs alone gave it 0 bytes, so a fused step cost no time."""
    params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(3)]
    for param in params:
        param.grad = torch.ones(1000)
    optimizer = torch.optim.AdamW(params, fused=True)
    counter = StepCounter()
    with counter, counter.phase("optimizer"):
        optimizer.step()
    fused = [cost for cost in counter.counts.costs if cost.name == "_fused_adamw_"]
    assert len(fused) == 1
    steps = 3 * 4  # the fp32 step counters (one scalar per parameter) are read as well
    assert fused[0].bytes == 32 * 3000 + steps


def test_a_kernel_given_a_bf16_operand_is_priced_at_the_bf16_tensor_peak() -> None:
    """The Mamba-2 op returns fp32, so its backward gets an fp32 gradient beside bf16 activations; mamba_ssm casts the
    gradient and multiplies on bf16 tensor cores. Priced by its first floating input (the fp32 gradient), the
    backward ran at the fp32 CUDA-core peak: 1.25 s of Nemotron Super's step at Automodel's benchmark shape where the
    bf16 roofline gives 0.08 s. The fp32 router matmul (all inputs fp32) stays at the fp32 peak."""
    import nemo_ac.models.kernels.mamba_ssm  # noqa: F401  (registers the op and its FLOP formulas)
    from nemo_ac.simulate.gpus import GPUS

    seq = 16
    x = torch.empty(1, seq, 4, 8, device="meta", dtype=torch.bfloat16)
    bc = torch.empty(1, seq, 2, 16, device="meta", dtype=torch.bfloat16)
    dt = torch.empty(1, seq, 4, device="meta", dtype=torch.bfloat16)
    conv = tuple(
        torch.empty(shape, device="meta") for shape in ((4, 8, 4), (4, 8), (2, 16, 4), (2, 16), (2, 16, 4), (2, 16))
    )
    heads = torch.empty(4, device="meta")
    doc = torch.zeros(1, seq, device="meta", dtype=torch.int64)
    tensors = [x, bc, bc, dt, *conv, heads, heads, heads]
    router_input, router_weight = torch.empty(seq, 32, device="meta"), torch.empty(32, 8, device="meta")
    counter = StepCounter()
    with counter:
        y = torch.ops.nemo_ac.mamba_chunk_scan(*tensors, doc, 8, 0.0, float("inf"))
        torch.ops.nemo_ac.mamba_chunk_scan_backward(y, tensors, doc, 8, 0.0, float("inf"))
        torch.mm(router_input, router_weight)
    bits = {cost.name: cost.bits for cost in counter.counts.costs}
    assert y.dtype == torch.float32
    assert bits == {"mamba_chunk_scan": 16, "mamba_chunk_scan_backward": 16, "mm": 32}
    backward = next(cost for cost in counter.counts.costs if cost.name == "mamba_chunk_scan_backward")
    h100 = GPUS["h100-80gb"]
    assert backward.flops > 0 and h100.matmul_flops(backward.bits) == h100.bf16_flops


def test_an_async_call_leaves_the_critical_path_for_the_compute_before_its_first_read() -> None:
    """``comm_overlap``: a call in flight from cost ``at`` to ``read_at`` hides min(W, (1 - f) C) of its C seconds
    behind the W seconds of compute in between, f being the SMs DeepEP's kernels hold."""
    from nemo_ac.simulate.counters import CollectiveCall, CollectiveRecord, StepCounts
    from nemo_ac.simulate.estimate import collective_seconds, comm_overlap, cost_seconds, estimate_step
    from nemo_ac.simulate.gpus import DEEPEP_SMS, GPUS
    from nemo_ac.simulate.op_cost import OpCost

    h100 = GPUS["h100-80gb"]
    gemm = OpCost(flops=2 * 4096**3, bytes=3 * 2 * 4096**2, bits=16, phase="forward", name="mm")
    wire = 256 * 2**20
    call = CollectiveCall(at=0, label="ep", kind="deepep", overlapped=False, phase="forward", wire_bytes=wire,
                          network_bytes=0, ranks=tuple(range(8)))  # fmt: skip
    transfer = collective_seconds(CollectiveRecord(calls=1, wire_bytes=wire, ranks=call.ranks), "deepep", gpu=h100)
    window = cost_seconds(gemm, gpu=h100)
    f = DEEPEP_SMS / h100.sms
    for gemms, hidden in ((1, min(window, (1 - f) * transfer)), (40, (1 - f) * transfer)):
        counts = StepCounts(costs=[gemm] * (gemms + 1), calls=[dataclasses.replace(call, read_at=gemms)])
        assert comm_overlap(counts, gpu=h100) == pytest.approx(hidden)
        counts.collectives[("ep", "deepep", False)] = CollectiveRecord(calls=1, wire_bytes=wire, ranks=call.ranks)
        estimate = estimate_step(counts, gpu=h100)
        assert estimate.step_s == pytest.approx(estimate.compute_s + transfer - hidden)
    assert window < (1 - f) * transfer  # the first case is bound by the compute, the second by the transfer
    blocking = StepCounts(costs=[gemm] * 2, calls=[call])  # read_at None: it blocks where it is issued
    assert comm_overlap(blocking, gpu=h100) == 0
