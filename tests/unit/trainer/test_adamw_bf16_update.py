"""The bf16 AdamW update as one kernel (``trainer/adamw_bf16_update.py``): inductor compiles it once for every
parameter length and step (no recompile across a schedule), its result is the eager update's to fp32 rounding
(bitwise the same noise), and the dry run counts it as one op reading four tensors and writing three."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from nemo_ac.trainer.adamw_bf16_update import adamw_update, fused_adamw_update_, rounding_noise, update_key
from nemo_ac.trainer.adamw_low_precision import AdamWLowPrecision
from tests.factories import RecordedOps

LENGTHS = (1000, 4096, 777)


def _tensors(length: int, *, param_dtype: torch.dtype, state_dtype: torch.dtype, device: str = "cpu"):
    generator = torch.Generator().manual_seed(length)
    param = (torch.randn(length, generator=generator) * 0.02).to(device=device, dtype=param_dtype)
    grad = (torch.randn(length, generator=generator) * 1e-3).to(device=device, dtype=param_dtype)
    exp_avg = (torch.randn(length, generator=generator) * 1e-3).to(device=device, dtype=state_dtype)
    exp_avg_sq = (torch.rand(length, generator=generator) * 1e-6).to(device=device, dtype=state_dtype)
    return param, grad, exp_avg, exp_avg_sq


def _scalars(step: int, lr: float, device: str = "cpu") -> torch.Tensor:
    beta1, beta2, eps, weight_decay = 0.9, 0.95, 1e-8, 0.1
    correction1, correction2 = 1 - beta1**step, 1 - beta2**step
    return torch.tensor(
        [1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, correction2**0.5, eps, -lr / correction1],
        dtype=torch.float32, device=device,
    )  # fmt: skip


def test_the_noise_is_uniform_16_bit_and_unrelated_between_keys() -> None:
    noise = rounding_noise(1 << 18, update_key(1234, 3, 7), device=torch.device("cpu"))
    assert noise.min().item() >= 0 and noise.max().item() < 1 << 16
    assert noise.float().mean().item() == pytest.approx((1 << 16) / 2, rel=0.01)
    next_step = rounding_noise(1 << 18, update_key(1234, 3, 8), device=torch.device("cpu"))
    correlation = torch.corrcoef(torch.stack([noise.float(), next_step.float()]))[0, 1].item()
    assert abs(correlation) < 0.01
    assert not torch.equal(noise[1:], next_step[:-1])  # not the same stream shifted by one


@pytest.mark.parametrize(
    ("param_dtype", "state_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
)
def test_one_compiled_graph_serves_every_length_and_step_and_matches_eager(param_dtype, state_dtype) -> None:
    """inductor (C++ here, Triton on CUDA) over three lengths and three steps of a changing learning rate: one
    frame, one graph, the eager update's values: bitwise but for a few elements, where inductor's fused multiply-adds
    move an fp32 value by an ulp (and its bf16 rounding, rarely, by a step)."""
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(adamw_update, backend=counter, dynamic=True, fullgraph=True)
    inductor = torch.compile(adamw_update, dynamic=True, fullgraph=True)
    for step, length in enumerate(LENGTHS, start=1):
        scalars, key = _scalars(step, lr=1e-3 / step), torch.tensor(update_key(7, length, step))
        eager = _tensors(length, param_dtype=param_dtype, state_dtype=state_dtype)
        counted = _tensors(length, param_dtype=param_dtype, state_dtype=state_dtype)
        fused = _tensors(length, param_dtype=param_dtype, state_dtype=state_dtype)
        adamw_update(*eager, scalars, key)
        compiled(*counted, scalars, key)
        inductor(*fused, scalars, key)
        for a, b, c in zip(eager, counted, fused, strict=True):
            assert torch.equal(a, b)  # the traced graph run eagerly is the eager function
            # fp32 results differ by an ulp where inductor contracts a multiply-add; one rounded in bf16 then by
            # at most one bf16 step (2^-7 relative), or by an ulp of the fp32 scale where the update nearly cancels.
            relative = 2**-7 if a.dtype == torch.bfloat16 else 1e-6
            scale = a.float().abs().max().item()
            assert torch.allclose(a.float(), c.float(), rtol=relative, atol=1e-6 * scale)
            if a.dtype == torch.bfloat16:
                assert (a != c).float().mean().item() < 0.01  # the rounding (the same noise) bitwise almost always
    assert counter.frame_count == 1 and counter.op_count > 0  # one graph for every length and learning rate


def test_the_fused_optimizer_runs_one_op_per_parameter_compiled_once_and_steps_as_the_eager_one() -> None:
    """``AdamWLowPrecision(fused=True)`` (the built-in AdamW on CUDA) over three steps of two parameter shapes: one
    ``nemo_ac::adamw_bf16_update_`` per parameter and step (no eager elementwise op beside it), one compiled graph
    for both shapes and every step, and the eager optimizer's parameters (up to fma ulps, as above)."""

    def params() -> list[torch.nn.Parameter]:
        generator = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(torch.bfloat16)) for shape in
                ((64, 16), (33,))]  # fmt: skip

    fused_params, eager_params = params(), params()
    fused = AdamWLowPrecision(fused_params, lr=1e-2, fused=True)
    eager = AdamWLowPrecision(eager_params, lr=1e-2, fused=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    seen: list[str] = []
    for step in range(3):
        for a, b in zip(fused_params, eager_params, strict=True):
            a.grad = b.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        with RecordedOps() as ops:
            fused.step()
        seen += ops.names
        eager.step()
    assert seen.count("adamw_bf16_update_") == 6
    assert not {"add", "mul", "copy_", "bitwise_and"} & set(seen)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for a, b in zip(fused_params, eager_params, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-6)


def test_the_dry_run_of_a_gpu_plan_counts_one_kernel_per_parameter_at_its_traffic() -> None:
    """On a CUDA plan the built-in AdamW is fused: each bf16 parameter's update is one op that reads the
    parameter, gradient and both moments once and writes the three stored tensors (its schema marks them)."""
    from pathlib import Path

    from nemo_ac.config import load_recipe, validate_recipe
    from nemo_ac.simulate.run import SimulationOptions, simulate

    tiny = Path(__file__).resolve().parents[3] / "recipes/tiny/qwen3_moe_tiny.yaml"
    overrides = ["dist.device=cuda", "dist.backend=nccl", "parallel.fsdp.param_dtype=bfloat16",
                 "train.master_dtype=bfloat16", "train.optimizer_state_dtype=bfloat16"]  # fmt: skip
    recipe = load_recipe(tiny, overrides)
    result = simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))
    optimizer_ops = [cost for cost in result.measurement.counts.costs if cost.phase == "optimizer"]
    updates = [cost for cost in optimizer_ops if cost.name == "adamw_bf16_update_"]
    clipping = ("_foreach_norm", "_foreach_mul_")  # the gradient clipping, counted in the optimizer phase
    others = [
        cost for cost in optimizer_ops if cost.name not in ("adamw_bf16_update_", *clipping) and cost.bytes > 4096
    ]
    assert updates and not others, others  # beside the kernels only scalars (step counts, per-tensor norms)
    parameter_bytes = result.measurement.phase_peaks["optimizer"].terms["parameters"]  # this rank's bf16 shards
    # Each update: the parameter, gradient and two moments read, the parameter and moments written (+ the scalars).
    assert sum(cost.bytes for cost in updates) == pytest.approx(7 * parameter_bytes, rel=0.01)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; runs in benchmarks/gpu_check.sh")
def test_cuda_the_triton_kernel_is_the_eager_cpu_update() -> None:
    """On CUDA the op compiles to Triton: one graph over every length and step, the same noise as on CPU (the hash
    is integer arithmetic), values as the eager CPU update's up to fma ulps."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for step, length in enumerate((1 << 20, 4096, 777), start=1):
        scalars, key = _scalars(step, lr=1e-3 / step), torch.tensor(update_key(7, length, step))
        cpu = _tensors(length, param_dtype=torch.bfloat16, state_dtype=torch.bfloat16)
        cuda = _tensors(length, param_dtype=torch.bfloat16, state_dtype=torch.bfloat16, device="cuda")
        adamw_update(*cpu, scalars, key)
        fused_adamw_update_(*cuda, scalars.cuda(), key.cuda())
        for a, b in zip(cpu, cuda, strict=True):
            assert torch.allclose(a.float(), b.float().cpu(), rtol=2**-7, atol=1e-6 * a.float().abs().max().item())
            assert (a != b.cpu()).float().mean().item() < 0.01
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
