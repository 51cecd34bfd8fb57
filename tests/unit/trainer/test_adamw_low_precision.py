"""``train.optimizer_state_dtype: bfloat16`` and ``train.master_dtype: bfloat16``: AdamW's moments and the parameters
themselves in bf16, each written back with stochastic rounding. The update is torch's AdamW (bitwise, with fp32
moments and parameters), the rounding is unbiased, bf16 parameters keep updates plain AdamW loses, a checkpoint round
trip continues bitwise, a small model trains as with fp32 over 150 steps, and the dry run counts half the bytes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from nemo_ac.config import ConfigError, load_recipe, validate_recipe
from nemo_ac.simulate.gpus import gpu_spec
from nemo_ac.simulate.report import PlanReport
from nemo_ac.simulate.run import SimulationOptions, simulate
from nemo_ac.trainer.adamw_bf16_update import stochastic_round_to_bf16, update_key
from nemo_ac.trainer.adamw_low_precision import AdamWLowPrecision
from tests.factories import mlp_regression_losses, optimizer_test_groups, optimizer_test_params, train_optimizer

ROOT = Path(__file__).resolve().parents[3]


def test_with_fp32_moments_every_update_is_bitwise_torchs_adamw() -> None:
    """The update is torch's single-tensor AdamW line for line: with fp32 moments nothing differs, which leaves
    the bf16 policy's only difference in the rounding of the two stored moments."""
    ours, theirs = optimizer_test_params(), optimizer_test_params()
    mine = AdamWLowPrecision(optimizer_test_groups(ours), lr=1e-2, betas=(0.9, 0.95), state_dtype=torch.float32)
    torch_adamw = torch.optim.AdamW(optimizer_test_groups(theirs), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    train_optimizer(mine, ours, range(12))
    train_optimizer(torch_adamw, theirs, range(12))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(mine.state[a]["exp_avg_sq"], torch_adamw.state[b]["exp_avg_sq"])


def test_stochastic_rounding_is_unbiased_and_lands_on_a_bf16_neighbour() -> None:
    """Mean of many roundings of one value = the value (round-to-nearest would be off by up to half a bf16 step,
    and would never move a moment by an increment below that); every result is one of the two neighbours."""
    value = torch.full((200_000,), 1.0 + 3 * 2**-10)  # 3/8 of the way from 1.0 to the next bf16 (1 + 2^-7)
    rounded = stochastic_round_to_bf16(value, key=update_key(1, 0, 0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert rounded.mean().item() == pytest.approx(1.0 + 3 * 2**-10, abs=2e-5)
    nearest = value.to(torch.bfloat16).float()
    assert (nearest == 1.0).all()  # round-to-nearest loses the increment entirely
    negative = stochastic_round_to_bf16(-value, key=update_key(1, 0, 0)).float()
    assert torch.equal(negative, -rounded)  # the magnitude rounds alike for either sign


def test_bf16_moments_halve_the_state_and_a_round_trip_continues_bitwise() -> None:
    """The noise is seeded by (seed, parameter, step): a resumed optimizer draws what the uninterrupted one drew."""
    straight = optimizer_test_params()
    optimizer = AdamWLowPrecision(optimizer_test_groups(straight), lr=1e-2, seed=7)
    train_optimizer(optimizer, straight, range(6))
    assert {state["exp_avg"].dtype for state in optimizer.state.values()} == {torch.bfloat16}
    saved_params = [p.detach().clone() for p in straight]
    saved = copy.deepcopy(optimizer.state_dict())
    train_optimizer(optimizer, straight, range(6, 12))
    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    restored = AdamWLowPrecision(optimizer_test_groups(resumed), lr=1e-2, seed=7)
    restored.load_state_dict(saved)
    assert {state["exp_avg_sq"].dtype for state in restored.state.values()} == {torch.bfloat16}  # torch casts to fp32
    train_optimizer(restored, resumed, range(6, 12))
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def _bf16_params(values: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(value.to(torch.bfloat16)) for value in values]


def _step_bf16(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    """``train_optimizer`` for bf16 parameters: the same seeded gradients, in bf16 (as FSDP hands them over)."""
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for index, param in enumerate(params):
            grad = torch.randn(param.shape, generator=generator).to(torch.bfloat16)
            param.grad = None if (step + index) % 5 == 0 else grad
        optimizer.step()


def test_bf16_parameters_keep_the_updates_plain_adamw_rounds_away() -> None:
    """A fine-tuning step (lr 1e-5, every gradient positive) on weights of 0.02: each AdamW update is about 1e-5,
    below half a bf16 step there (2^-14, 6.1e-5), so torch's AdamW on bf16 weights rounds every update away and the
    weights never move, where the fp32-master run moves each by 50 * 1e-5. The stochastically rounded bf16 weights
    move by that amount on average (the rounding is unbiased)."""
    start = torch.full((50_000,), 0.02).to(torch.bfloat16)  # 0.0200195..., on the bf16 grid (steps of 2^-13)
    grads = torch.rand(50, 50_000, generator=torch.Generator().manual_seed(3)) + 0.5

    def run(optimizer_cls: type, param: torch.nn.Parameter) -> torch.Tensor:
        optimizer = optimizer_cls([param], lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
        for grad in grads:
            param.grad = grad.to(param.dtype)
            optimizer.step()
        return start.float() - param.detach().float()

    fp32 = run(torch.optim.AdamW, torch.nn.Parameter(start.float()))
    plain = run(torch.optim.AdamW, torch.nn.Parameter(start.clone()))
    rounded = run(AdamWLowPrecision, torch.nn.Parameter(start.clone()))
    assert fp32.mean().item() == pytest.approx(50 * 1e-5, rel=0.05)  # each update a little under lr
    assert (plain == 0).all()  # round-to-nearest: not one update kept
    # Unbiased: the mean over 50,000 weights within 1% of fp32's (its standard error here is about 0.4%).
    assert rounded.mean().item() == pytest.approx(fp32.mean().item(), rel=0.01)
    assert rounded.std().item() > 0  # each weight a random walk on the grid around fp32's path


def test_bf16_parameters_with_fp32_moments_round_trip_bitwise() -> None:
    """torch's ``load_state_dict`` casts each state to its parameter's dtype: fp32 moments of bf16 parameters would
    come back rounded to bf16 and the resumed run would part from the uninterrupted one. They come back as saved."""
    values = [p.detach() for p in optimizer_test_params()]
    straight = _bf16_params(values)
    optimizer = AdamWLowPrecision(optimizer_test_groups(straight), lr=1e-2, state_dtype=torch.float32, seed=7)
    _step_bf16(optimizer, straight, range(6))
    assert {state["exp_avg"].dtype for state in optimizer.state.values()} == {torch.float32}
    saved_params = [p.detach().clone() for p in straight]
    saved = copy.deepcopy(optimizer.state_dict())
    _step_bf16(optimizer, straight, range(6, 12))
    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    restored = AdamWLowPrecision(optimizer_test_groups(resumed), lr=1e-2, state_dtype=torch.float32, seed=7)
    restored.load_state_dict(saved)
    assert {state["exp_avg_sq"].dtype for state in restored.state.values()} == {torch.float32}
    _step_bf16(restored, resumed, range(6, 12))
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    assert {p.dtype for p in resumed} == {torch.bfloat16}


def test_a_small_model_trains_as_with_fp32_moments_over_150_steps() -> None:
    """A two-layer MLP regression, 150 steps at a learning rate of 1e-2, the loss falling from about 1 to 1e-4: at
    every step the bf16-moment loss lies within 0.1% of the starting loss from the fp32 one (measured: 0.015%).
    Why that tolerance: each stored moment carries an unbiased relative rounding error below 2^-8, so each update
    differs from fp32's by a fraction of a percent of itself, and the difference in the loss it makes is that
    fraction of the loss's fall per step; relative to the loss itself the curves cannot be compared late, where
    both sit at the fit's noise floor (1e-4) and any perturbation is 100% of it."""

    def run(state_dtype: torch.dtype) -> list[float]:
        return mlp_regression_losses(
            lambda params: AdamWLowPrecision(params, lr=1e-2, betas=(0.9, 0.95), state_dtype=state_dtype)
        )

    fp32, bf16 = run(torch.float32), run(torch.bfloat16)
    assert bf16[-1] < 0.001 * bf16[0] and fp32[-1] < 0.001 * fp32[0]  # both train
    assert max(abs(b - f) for f, b in zip(fp32, bf16, strict=True)) <= 0.001 * fp32[0]
    assert bf16 != fp32  # the rounding does act


def test_a_small_model_with_bf16_weights_trains_as_with_fp32_weights_over_150_steps() -> None:
    """The same regression with its four weights stored in bf16 (the forward reads them into fp32, so only the
    masters' precision differs): at every step the loss lies within 0.5% of the starting loss from the fp32-weight
    run's (measured: 0.22%; bf16 moments too: 0.36%). Why that tolerance: each stored weight sits within one bf16
    step (2^-8 of itself) of its fp32 path, unbiased, so the loss differs by the gradient times that, a fraction of a
    percent of the loss's scale early on; late the bf16 weights jitter by a step around the minimum, so the loss
    floor is higher (3e-4 against 8e-5), which is why the curves are compared to the starting loss."""
    torch.manual_seed(0)
    inputs, weights = torch.randn(256, 16), torch.randn(16, 1)
    targets = torch.tanh(inputs @ weights) + 0.05 * torch.randn(256, 1)

    def run(master: torch.dtype, state_dtype: torch.dtype) -> list[float]:
        generator = torch.Generator().manual_seed(1)
        shapes = [(64, 16), (64,), (1, 64), (1,)]
        params = [torch.nn.Parameter((torch.randn(s, generator=generator) * 0.3).to(master)) for s in shapes]
        optimizer = AdamWLowPrecision(params, lr=1e-2, betas=(0.9, 0.95), state_dtype=state_dtype)
        losses = []
        for _ in range(150):
            w1, b1, w2, b2 = (param.float() for param in params)
            loss = torch.nn.functional.mse_loss(torch.tanh(inputs @ w1.T + b1) @ w2.T + b2, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    fp32 = run(torch.float32, torch.float32)
    for state_dtype in (torch.float32, torch.bfloat16):
        bf16 = run(torch.bfloat16, state_dtype)
        assert bf16[-1] < 0.001 * bf16[0]  # trains
        assert max(abs(b - f) for f, b in zip(fp32, bf16, strict=True)) <= 0.005 * fp32[0]
        assert bf16 != fp32


def test_the_recipe_key_is_refused_where_it_cannot_apply_and_the_dry_run_counts_half_the_states() -> None:
    tiny = ROOT / "recipes/tiny/qwen3_moe_tiny.yaml"
    custom = load_recipe(tiny, ["train.optimizer_state_dtype=bfloat16", "+train.optimizer={_target_: torch.optim.SGD}"])
    with pytest.raises(ConfigError, match=r"train.optimizer_state_dtype: bfloat16 stores the built-in AdamW"):
        validate_recipe(custom, world_size=2)
    host = load_recipe(tiny, ["train.optimizer_state_dtype=bfloat16", "train.optimizer_offload=states"])
    with pytest.raises(ConfigError, match=r"train.optimizer_state_dtype: bfloat16 moments are not kept on the host"):
        validate_recipe(host, world_size=2)
    states = {}
    for dtype in ("float32", "bfloat16"):
        recipe = load_recipe(tiny, [f"train.optimizer_state_dtype={dtype}"])
        result = simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))
        states[dtype] = result.measurement.phase_peaks["optimizer"].terms["optimizer states"]
    # The moments halve; the step scalars (fp32, one per parameter) stay.
    assert states["bfloat16"] == pytest.approx(states["float32"] / 2, rel=0.05)


def test_the_dry_run_counts_bf16_masters_at_half_the_parameter_and_gradient_bytes() -> None:
    """The same recipe with bf16 compute, fp32 against bf16 masters: parameters and gradients at the optimizer step
    halve (the tiny Qwen3 MoE has no fp32 router), the plan says so, and the report names the update."""
    tiny = ROOT / "recipes/tiny/qwen3_moe_tiny.yaml"
    terms, reports = {}, {}
    for dtype in ("float32", "bfloat16"):
        recipe = load_recipe(tiny, ["parallel.fsdp.param_dtype=bfloat16", f"train.master_dtype={dtype}"])
        result = simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))
        terms[dtype] = result.measurement.phase_peaks["optimizer"].terms
        reports[dtype] = "\n".join(PlanReport.build(result, [gpu_spec("h100-80gb")]).lines())
    for term in ("parameters", "gradients"):
        assert terms["bfloat16"][term] == pytest.approx(terms["float32"][term] / 2, rel=0.01)
    assert "| bfloat16 masters" in reports["bfloat16"] and "masters" not in reports["float32"]
    assert "built-in AdamW with bfloat16 parameters (stochastic rounding)" in reports["bfloat16"]
