"""``train.optimizer_offload: states``: AdamW with its moments in host memory updates every parameter bitwise as
torch's AdamW does, keeps its states on the host across a checkpoint round trip, and the dry run moves them off the
device's accounting onto the host link."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.gpus import GPUS
from nemo_ac.simulate.report import PlanReport
from nemo_ac.simulate.run import SimulationOptions, simulate
from nemo_ac.trainer.host_optimizer_states import AdamWHostStates
from tests.factories import optimizer_test_groups, optimizer_test_params, train_optimizer

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("bucket_bytes", [1, 3000, 2**30], ids=["per_tensor", "small", "one_bucket"])
def test_every_update_is_bitwise_torchs_adamw(fused: bool, bucket_bytes: int) -> None:
    plain, offloaded = optimizer_test_params(), optimizer_test_params()
    options = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    reference = torch.optim.AdamW(optimizer_test_groups(plain), foreach=not fused, fused=fused or None, **options)
    optimizer = AdamWHostStates(optimizer_test_groups(offloaded), fused=fused, bucket_bytes=bucket_bytes, **options)
    train_optimizer(reference, plain, range(40))
    train_optimizer(optimizer, offloaded, range(40))
    for a, b in zip(plain, offloaded, strict=True):
        assert torch.equal(a, b)
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(reference.state[a][name], optimizer.state[b][name]), name
    assert optimizer.host_state_bytes() == 2 * sum(p.numel() * 4 for p in offloaded)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; runs in benchmarks/gpu_check.sh")
def test_on_cuda_pinned_states_and_async_copies_are_bitwise_the_fused_adamw() -> None:
    """The GPU path: fused AdamW on the device, the moments in pinned host memory, copies non-blocking."""
    plain = [torch.nn.Parameter(p.detach().cuda()) for p in optimizer_test_params()]
    offloaded = [torch.nn.Parameter(p.detach().cuda()) for p in optimizer_test_params()]
    reference = torch.optim.AdamW(optimizer_test_groups(plain), lr=1e-2, fused=True)
    optimizer = AdamWHostStates(optimizer_test_groups(offloaded), lr=1e-2, fused=True, bucket_bytes=3000)
    for step in range(20):
        for a, b in zip(plain, offloaded, strict=True):
            grad = torch.randn(a.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            a.grad, b.grad = grad.clone(), grad.clone()
        reference.step()
        optimizer.step()
    for a, b in zip(plain, offloaded, strict=True):
        assert torch.equal(a, b)
        state = optimizer.state[b]
        assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].is_pinned()
        assert torch.equal(reference.state[a]["exp_avg_sq"], state["exp_avg_sq"].cuda())


def test_a_state_dict_round_trip_keeps_the_states_on_the_host_and_continues_bitwise() -> None:
    """torch's ``load_state_dict`` puts states on their parameter's device; the moments must go back to the host
    (the "meta" host here stands in for host memory, so a state left on the parameter's device shows)."""
    straight = optimizer_test_params()
    optimizer = AdamWHostStates(optimizer_test_groups(straight), lr=1e-2)
    train_optimizer(optimizer, straight, range(6))
    saved_params = [p.detach().clone() for p in straight]
    saved = copy.deepcopy(optimizer.state_dict())  # state_dict() holds the live tensors
    train_optimizer(optimizer, straight, range(6, 10))

    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    restored = AdamWHostStates(optimizer_test_groups(resumed), lr=1e-2, host="meta")
    restored.load_state_dict(saved)
    assert {state["exp_avg"].device.type for state in restored.state.values()} == {"meta"}
    plain = torch.optim.AdamW(optimizer_test_groups([torch.nn.Parameter(p.clone()) for p in saved_params]), lr=1e-2)
    plain.load_state_dict(saved)  # the same keys and tensors: a plain AdamW takes the checkpoint too
    restored_on_cpu = AdamWHostStates(optimizer_test_groups(resumed), lr=1e-2)
    restored_on_cpu.load_state_dict(saved)
    train_optimizer(restored_on_cpu, resumed, range(6, 10))
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def test_the_dry_run_keeps_offloaded_states_off_the_device_and_times_their_copies() -> None:
    overrides = ["dist.device=cuda", "dist.backend=nccl"]
    runs = {}
    for policy in ("none", "states"):
        recipe = load_recipe(
            ROOT / "recipes/tiny/qwen3_moe_tiny.yaml", [*overrides, f"train.optimizer_offload={policy}"]
        )
        runs[policy] = simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))
    on_device, offloaded = runs["none"], runs["states"]
    states = on_device.measurement.phase_peaks["optimizer"].terms["optimizer states"]
    # The moments leave the device (its step scalars stay); the host holds them, as many bytes.
    assert offloaded.host_bytes["optimizer states"] == pytest.approx(states, rel=0.05)
    assert offloaded.measurement.phase_peaks["optimizer"].terms["optimizer states"] < states // 20
    assert on_device.host_bytes == {}
    h100 = GPUS["h100-80gb"]
    report = PlanReport.build(offloaded, [h100])
    estimate, fit = report.estimates[0], report.fits[0]
    moved = 2 * offloaded.host_bytes["optimizer states"]  # to the device and back, on the compute stream
    assert estimate.host_exposed_s == pytest.approx(moved / (h100.host_link_bytes_per_s * 0.8))
    assert estimate.step_s >= PlanReport.build(on_device, [h100]).estimates[0].step_s + estimate.host_exposed_s * 0.99
    assert fit.host_bytes_per_node == 2 * offloaded.host_bytes["optimizer states"]  # 2 ranks on one node
    assert "host | per rank: optimizer states" in "\n".join(report.lines())
