"""``train.optimizer_state_dtype: float8``: AdamW's moments as e4m3 codes with a scale per 128 elements of a row
(``trainer/adamw_fp8_states.py``). The rounding is unbiased and lands on an e4m3 neighbour, a block round trip keeps
what e4m3 can hold, the optimizer tracks fp32 AdamW on a small model, its state is about a quarter of fp32's, a state
dict round trip continues bitwise, and the compiled update is one graph for every shape, as the eager one steps."""

from __future__ import annotations

import copy

import pytest
import torch

from nemo_ac.trainer import adamw_fp8_states as fp8
from nemo_ac.trainer.adamw_bf16_update import update_key
from nemo_ac.trainer.adamw_low_precision import AdamWLowPrecision
from tests.factories import (
    RecordedOps,
    mlp_regression_losses,
    optimizer_test_groups,
    optimizer_test_params,
    train_optimizer,
)


def test_stochastic_rounding_to_e4m3_is_unbiased_and_lands_on_a_neighbour() -> None:
    """Between 1.0 and 1.125 (e4m3's step there) and in the subnormal range (steps of 2^-9): every result one of
    the two neighbours, the mean the value; round-to-nearest would give 1.0 every time, and 0 below 2^-10."""
    for value, low, high in ((1.0 + 0.125 * 3 / 8, 1.0, 1.125), (2**-9 * 0.3, 0.0, 2**-9)):
        values = torch.full((200_000,), value)
        rounded = fp8.stochastic_round_to_fp8(values, key=update_key(3, 0, 1)).float()
        assert set(rounded.unique().tolist()) == {low, high}
        assert rounded.mean().item() == pytest.approx(value, rel=0.01)
        assert torch.equal(fp8.stochastic_round_to_fp8(-values, key=update_key(3, 0, 1)).float(), -rounded)
        assert (values.to(fp8.FP8).float() == low).all()
    exact = torch.tensor([0.0, 448.0, -448.0, 1.0, 2**-9, 240.0])
    assert torch.equal(fp8.stochastic_round_to_fp8(exact, key=update_key(0, 0, 0)).float(), exact)


@pytest.mark.parametrize("shape", [(3, 256), (5, 200), (2, 3, 4), (7, 130)])
def test_blocks_hold_each_row_to_e4m3_precision(shape: tuple[int, ...]) -> None:
    """Each block of 128 (a row's tail zero padded) scales its largest magnitude to 448: that element comes back
    (to an fp32 ulp), every other within e4m3's relative step (2^-3, stochastic) or its subnormal step (2^-9 of the
    scale), and a zero block stays zero (no division by a zero scale)."""
    width = shape[-1]
    value = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, width)
    value[0] = 0.0
    codes = torch.empty(shape, dtype=fp8.FP8)
    scales = torch.empty((*shape[:-1], fp8.blocks_per_row(width)))
    fp8.quantize_into(value.reshape(-1), codes, scales, width=width, key=update_key(0, 1, 2))
    back = fp8.dequantize(codes, scales, width).view(shape)
    assert (back[0] == 0).all() and (scales[0] == 0).all()
    blocks = torch.nn.functional.pad(value.reshape(-1, width), (0, fp8.blocks_per_row(width) * 128 - width))
    scale = blocks.view(blocks.shape[0], -1, 128).abs().amax(-1) / 448
    assert torch.equal(scales.reshape(-1), scale.reshape(-1))
    per_element = torch.repeat_interleave(scale, 128, dim=1)[:, :width].reshape(shape)
    assert ((back - value).abs() <= value.abs() * 2**-3 + per_element * 2**-9 + 1e-12).all()
    largest = value.abs().reshape(-1, width).argmax(dim=1)
    rows = torch.arange(largest.numel())
    assert torch.allclose(back.reshape(-1, width)[rows, largest], value.reshape(-1, width)[rows, largest], rtol=1e-6)


def test_a_small_model_trains_as_with_fp32_moments_over_150_steps() -> None:
    """The bf16-moment test's MLP regression (``test_adamw_low_precision.py``), fp8 moments against fp32's: at every
    step within 1% of the starting loss (measured over eight noise seeds: 0.10-0.25%; bf16 moments 0.006%), and the
    last loss within 30% of fp32's (eight seeds: 0.78x-1.18x, either side: noise, not a bias). Why: each stored
    moment carries an unbiased relative rounding error up to 2^-3 (e4m3's step), 2^5 times bf16's; each update then
    differs from fp32's by a few percent of itself, not compounding, so the curves part by a small fraction of each
    step's fall; at the end, where the loss is 0.2% of its start and each step moves it little, that difference is a
    sizeable part of the loss itself."""

    def run(state_dtype: torch.dtype) -> list[float]:
        return mlp_regression_losses(
            lambda params: AdamWLowPrecision(params, lr=1e-2, weight_decay=0.0, state_dtype=state_dtype)
        )

    fp32, low = run(torch.float32), run(fp8.FP8)
    assert max(abs(a - b) for a, b in zip(fp32, low, strict=True)) < 0.01 * fp32[0]
    assert abs(low[-1] - fp32[-1]) < 0.3 * fp32[-1] and fp32[-1] < fp32[0] / 100


def test_the_state_is_a_quarter_of_fp32s_and_one_dim_parameters_keep_fp32() -> None:
    params = optimizer_test_params()
    optimizer = AdamWLowPrecision(optimizer_test_groups(params), lr=1e-2, state_dtype=fp8.FP8)
    train_optimizer(optimizer, params, range(6))
    for param in params:
        state = optimizer.state[param]
        if param.ndim >= 2:
            assert set(state) == {"step", *fp8.QUANTIZED_STATES}
            assert state[fp8.EXP_AVG].dtype == fp8.FP8 and state[fp8.EXP_AVG].shape == param.shape
            assert state[fp8.EXP_AVG_SCALE].shape == (*param.shape[:-1], fp8.blocks_per_row(param.shape[-1]))
        else:
            assert {state["exp_avg"].dtype, state["exp_avg_sq"].dtype} == {torch.float32}
    big = torch.nn.Parameter(torch.randn(64, 1024))
    optimizer = AdamWLowPrecision([big], lr=1e-2, state_dtype=fp8.FP8)
    big.grad = torch.randn_like(big)
    optimizer.step()
    state_bytes = sum(v.nbytes for v in optimizer.state[big].values() if isinstance(v, torch.Tensor) and v.ndim)
    assert state_bytes == 2 * big.numel() * (1 + 4 / 128)  # 2.06 bytes per parameter; fp32: 8


def test_a_state_dict_round_trip_continues_bitwise() -> None:
    """torch's ``load_state_dict`` would turn the e4m3 codes into numbers in the parameter's dtype; they come back
    as saved, and the noise (keyed by seed, parameter, step) continues the uninterrupted run bit for bit."""
    straight = optimizer_test_params()
    optimizer = AdamWLowPrecision(optimizer_test_groups(straight), lr=1e-2, state_dtype=fp8.FP8, seed=5)
    train_optimizer(optimizer, straight, range(6))
    saved_params = [p.detach().clone() for p in straight]
    saved = copy.deepcopy(optimizer.state_dict())
    train_optimizer(optimizer, straight, range(6, 12))
    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    restored = AdamWLowPrecision(optimizer_test_groups(resumed), lr=1e-2, state_dtype=fp8.FP8, seed=5)
    restored.load_state_dict(saved)
    dtypes = {name: value.dtype for state in restored.state.values() for name, value in state.items()}
    assert dtypes[fp8.EXP_AVG] == fp8.FP8 and dtypes[fp8.EXP_AVG_SCALE] == torch.float32
    train_optimizer(restored, resumed, range(6, 12))
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    bf16_moments = AdamWLowPrecision(optimizer_test_groups(resumed), lr=1e-2, state_dtype=torch.bfloat16)
    with pytest.raises(KeyError, match=r"saved with another train\.optimizer_state_dtype"):
        bf16_moments.load_state_dict(saved)


def test_the_fused_update_is_one_graph_for_every_shape_and_steps_as_the_eager_one() -> None:
    """``AdamWLowPrecision(fused=True)`` (the built-in AdamW on CUDA; inductor's C++ here) over three steps of three
    shapes, rows of 200, 64 and 1024: one ``nemo_ac::adamw_fp8_states_update_`` per parameter and step, one graph
    for every shape, width and step, and the eager optimizer's parameters and codes, but where inductor's fused
    multiply-adds move an fp32 value by an ulp and a rounding then lands on the other neighbour. bf16 parameters
    (``train.master_dtype: bfloat16``): both roundings, the parameter's and the codes', in the one kernel."""
    param_dtype = torch.bfloat16

    def params() -> list[torch.nn.Parameter]:
        generator = torch.Generator().manual_seed(0)
        shapes = ((8, 200), (2, 16, 64), (4, 1024))
        return [torch.nn.Parameter(torch.randn(s, generator=generator).to(param_dtype) * 0.02) for s in shapes]

    fused_params, eager_params = params(), params()
    fused = AdamWLowPrecision(fused_params, lr=1e-2, state_dtype=fp8.FP8, fused=True)
    eager = AdamWLowPrecision(eager_params, lr=1e-2, state_dtype=fp8.FP8, fused=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for step in range(3):
        for a, b in zip(fused_params, eager_params, strict=True):
            a.grad = b.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step)).to(param_dtype)
        with RecordedOps() as ops:
            fused.step()
        eager.step()
        assert ops.names.count("adamw_fp8_states_update_") == 3
        assert not {"add", "mul", "copy_", "abs", "scatter_reduce_"} & set(ops.names)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for a, b in zip(fused_params, eager_params, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2**-6, atol=1e-6)
        first_fused = fp8.moments_in_fp32(fused.state[a], a.shape[-1])[0]
        first_eager = fp8.moments_in_fp32(eager.state[b], b.shape[-1])[0]
        assert (first_fused != first_eager).float().mean().item() < 0.01


def test_the_dry_run_counts_a_quarter_of_the_states_and_one_kernel_per_parameter_on_a_gpu_plan() -> None:
    """The tiny Qwen3 MoE on 2 ranks: the optimizer states at the step fall to about 2.06 / 8 of fp32's (the
    norms' fp32 moments and the step counters stay); on a CUDA plan each quantized parameter's update is one op
    that reads the parameter, its gradient, the codes and scales once and writes all but the gradient (the fused
    kernel's traffic), and the report says how the moments are kept."""
    from pathlib import Path

    from nemo_ac.config import load_recipe, validate_recipe
    from nemo_ac.simulate.gpus import gpu_spec
    from nemo_ac.simulate.report import PlanReport
    from nemo_ac.simulate.run import SimulationOptions, simulate

    tiny = Path(__file__).resolve().parents[3] / "recipes/tiny/qwen3_moe_tiny.yaml"
    states = {}
    for dtype in ("float32", "float8"):
        recipe = load_recipe(tiny, [f"train.optimizer_state_dtype={dtype}"])
        result = simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))
        states[dtype] = result.measurement.phase_peaks["optimizer"].terms["optimizer states"]
    assert 2.06 / 8 < states["float8"] / states["float32"] < 0.3
    recipe = load_recipe(tiny, ["dist.device=cuda", "dist.backend=nccl", "train.optimizer_state_dtype=float8"])
    result = simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))
    optimizer_ops = [cost for cost in result.measurement.counts.costs if cost.phase == "optimizer"]
    updates = [cost for cost in optimizer_ops if cost.name == "adamw_fp8_states_update_"]
    eager = {cost.name for cost in optimizer_ops if cost.bytes > 4096} - {
        "adamw_fp8_states_update_", "_foreach_norm", "_foreach_mul_", "_fused_adamw_"
    }  # fmt: skip
    assert updates and not eager, eager
    parameter_bytes = result.measurement.phase_peaks["optimizer"].terms["parameters"]
    quantized = sum(cost.bytes for cost in updates)
    # Per element of an fp32 parameter: read 4 + 4 + 2 x 1 + 2 x 4/128, write 4 + 2 x 1 + 2 x 4/128 (16.125 bytes).
    assert quantized == pytest.approx(16.125 / 4 * parameter_bytes, rel=0.03)
    report = "\n".join(PlanReport.build(result, [gpu_spec("h100-80gb")]).lines())
    assert "built-in AdamW with float8 moments (e4m3 codes, an fp32 scale per 128 elements of a row)" in report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; runs in benchmarks/gpu_check.sh")
def test_cuda_the_triton_fp8_kernel_is_the_eager_cpu_update() -> None:
    """On CUDA the op compiles to Triton (the block maxima a scatter-amax): one graph over three shapes and steps,
    the same noise as on CPU, the parameter and the codes as the eager CPU update's up to fma ulps (a code then
    rounds to the other neighbour, rarely)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for step, shape in enumerate(((1024, 1024), (8, 200), (3, 5, 64)), start=1):
        generator = torch.Generator().manual_seed(step)
        param = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        grad = (torch.randn(shape, generator=generator) * 1e-3).to(torch.bfloat16)
        states = {name: value.contiguous() for name, value in fp8.new_states(param).items()}
        scalars = torch.tensor([1.0, 0.1, 0.95, 0.05, 0.05**0.5, 1e-8, -1e-3 / 0.1])
        key = torch.tensor(update_key(7, step, step))
        cpu = [param.clone(), grad, *(states[name].clone() for name in fp8.QUANTIZED_STATES)]
        cuda = [t.reshape(-1).clone().cuda() for t in cpu]  # flat, not views (as the optimizer passes them)
        fp8.adamw_fp8_update(*cpu, scalars, key, shape[-1])
        fp8.fused_adamw_fp8_update_(*cuda, scalars.cuda(), key.cuda(), shape[-1])
        assert torch.allclose(cpu[0].float().view(-1), cuda[0].float().cpu(), rtol=2**-7, atol=1e-6)
        for name, a, b in zip(fp8.QUANTIZED_STATES, cpu[2:], cuda[2:], strict=True):
            if name.endswith("_scale"):
                assert torch.allclose(a.view(-1), b.cpu(), rtol=1e-6)
            else:
                assert (a.float().view(-1) != b.float().cpu()).float().mean().item() < 0.01
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
