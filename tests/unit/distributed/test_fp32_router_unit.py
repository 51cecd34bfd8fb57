"""An fp32 router's FSDP unit (``fsdp.fp32_router_policy``): fp32 weights, the bf16 hidden states passed as they
come, and the same gradients as when FSDP cast them to fp32 (the router's fp32 GEMM casts them itself)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from nemo_ac.distributed.fsdp import fp32_router_policy
from nemo_ac.models.layers.router import TopKRouter

T, H, E = 24, 32, 8


def routed(policy: MixedPrecisionPolicy, fp32_gemm: str) -> tuple[list[torch.dtype], list[torch.Tensor]]:
    gate = TopKRouter(H, E, 2, score_func="sigmoid", router_dtype="float32", fp32_gemm=fp32_gemm)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(0)))
    seen: list[torch.dtype] = []
    gate.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    fully_shard(gate, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)  # its pre-hook runs before ours
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()
    scores, _, probs = gate(x)
    (scores.sum() + probs.pow(2).sum()).backward()
    return seen, [scores.detach(), x.grad, gate.weight.grad.full_tensor()]


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize("fp32_gemm", ["float32", "bf16x3"])
def test_the_router_sees_bf16_hidden_states_and_its_gradients_are_unchanged(fp32_gemm: str) -> None:
    seen, got = routed(fp32_router_policy(), fp32_gemm)
    assert seen == [torch.bfloat16]
    cast_seen, want = routed(MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32), fp32_gemm)
    assert cast_seen == [torch.float32]  # FSDP's default policy: an fp32 copy, the bf16x3 path never taken
    if fp32_gemm == "float32":
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
