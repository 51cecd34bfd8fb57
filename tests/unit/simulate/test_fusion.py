"""The estimate's fusion model (``nemo_ac.simulate.fusion``): what an op of a compiled block costs in bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.counters import StepCounter, StepCounts
from nemo_ac.simulate.estimate import estimate_step
from nemo_ac.simulate.fusion import CompiledRegions
from nemo_ac.simulate.gpus import GPUS
from nemo_ac.simulate.run import SimulationOptions, simulate

TINY = str(Path(__file__).resolve().parents[3] / "recipes/tiny/qwen3_moe_tiny.yaml")
N, D, E = 64, 32, 48
FP32 = 4


class Block(nn.Module):
    """A pointwise chain into a matmul, and a pointwise chain out of it: two fusion groups around one extern op."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))
        self.proj = nn.Parameter(torch.randn(D, E) / D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ((x * self.scale).sin() + 1.0) @ self.proj
        return h.relu() * 2.0


class Model(nn.Module):
    def __init__(self, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.block = checkpoint_wrapper(Block()) if checkpointed else Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).square().mean()  # outside the block: eager


def _count(model: nn.Module, *, compiled: bool) -> StepCounts:
    regions = CompiledRegions()
    if compiled:
        regions.attach(model, ["block"])
    counter = StepCounter(regions=regions)
    x = torch.randn(N, D, requires_grad=True)
    with counter:
        model(x).backward()
    regions.finish()  # ends the open backward instance, as the counter's reset after each micro batch does
    regions.detach()
    return counter.counts


def _costs(counts: StepCounts, phase: str) -> list:
    return [c for c in counts.costs if c.phase == phase]


def test_a_compiled_blocks_forward_moves_only_what_its_kernels_must() -> None:
    """Under activation checkpointing the forward saves nothing inside the block: mul -> sin -> add fuse into one
    kernel reading x and scale and writing the matmul's input; relu -> mul fuse into one reading the matmul's output
    and writing the block's output. The matmul (extern) keeps its bytes; the square and mean outside the block stay
    eager. Without the block compiled every op keeps its eager bytes."""
    torch.manual_seed(0)
    compiled = _count(Model(checkpointed=True), compiled=True)
    eager = _count(Model(checkpointed=True), compiled=False)
    forward = _costs(compiled, "forward")
    assert [c.name for c in forward[:6]] == ["mul", "sin", "add", "mm", "relu", "mul"]
    assert [c.fused_bytes for c in forward[:6]] == [
        N * D * FP32 + D * FP32,  # reads x and scale once
        0,
        N * D * FP32,  # writes the sum, which the matmul reads from memory
        forward[3].bytes,  # extern: its eager bytes
        N * E * FP32,  # reads the matmul's output
        N * E * FP32,  # writes the block's output (alive at the block's end)
    ]
    assert forward[3].compiled_bytes is None
    assert forward[6:] and all(c.compiled_bytes is None for c in forward[6:])
    assert all(c.compiled_bytes is None for c in eager.costs)
    assert [c.bytes for c in eager.costs] == [c.bytes for c in compiled.costs]


def test_what_a_compiled_forward_saves_for_backward_is_written() -> None:
    """Without checkpointing, sin's input and relu's output are saved for backward: alive when the block ends, so
    the fused kernels write them (AOTAutograd's forward graph returns them)."""
    torch.manual_seed(0)
    forward = _costs(_count(Model(), compiled=True), "forward")
    assert [c.name for c in forward[:5]] == ["mul", "sin", "add", "mm", "relu"]
    assert forward[0].fused_bytes == N * D * FP32 + D * FP32 + N * D * FP32
    assert forward[1].fused_bytes == 0
    assert forward[4].fused_bytes == 2 * N * E * FP32


def test_a_compiled_blocks_backward_is_fused_through_the_nodes_its_forward_made() -> None:
    """The backward of the block's ops runs in autograd nodes the block's forward created: those ops are fused
    (fewer bytes than eager), the loss's backward outside the block is not."""
    torch.manual_seed(0)
    counter = _count(Model(), compiled=True)
    backward = _costs(counter, "backward")
    inside = [c for c in backward if c.compiled_bytes is not None]
    outside = [c for c in backward if c.compiled_bytes is None]
    assert inside and outside
    assert sum(c.fused_bytes for c in inside) < sum(c.bytes for c in inside)
    assert {"threshold_backward", "cos"} <= {c.name for c in inside}  # relu's and sin's backward
    assert "pow" in {c.name for c in outside}  # square's backward, outside the block


def test_the_recompute_of_a_checkpointed_compiled_block_is_fused_too() -> None:
    """Under a checkpoint wrapper the hooks sit on the block inside it: the recompute in backward enters the
    region again, and what it saves for backward is written."""
    torch.manual_seed(0)
    counter = _count(Model(checkpointed=True), compiled=True)
    recompute = _costs(counter, "recompute")
    assert recompute and all(c.compiled_bytes is not None for c in recompute if c.name != "mm")
    assert sum(c.fused_bytes for c in recompute) < sum(c.bytes for c in recompute)


def test_the_estimate_is_the_fused_compute_and_the_bounds_stay_around_it() -> None:
    torch.manual_seed(0)
    counter = _count(Model(), compiled=True)
    estimate = estimate_step(counter, gpu=GPUS["h100-80gb"])
    assert estimate.compute_fused_s <= estimate.compute_s < estimate.compute_eager_s
    assert estimate.step_fused_s <= estimate.step_s < estimate.step_eager_s
    eager = estimate_step(_count(Model(), compiled=False), gpu=GPUS["h100-80gb"])
    assert eager.compute_s == eager.compute_eager_s


@pytest.mark.parametrize("compiled", [True, False])
def test_the_dry_run_fuses_exactly_the_blocks_the_plan_compiles(compiled: bool) -> None:
    """The tiny recipe's plan compiles every decoder block when compile.enabled: its estimate then costs them at the
    bytes fusion leaves (below the eager bound); with compile off the estimate is the eager op stream."""
    recipe = load_recipe(TINY, [f"compile.enabled={str(compiled).lower()}"])
    simulation = simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))
    assert all((block.compile_layout is not None) is compiled for block in simulation.plan.decoder_blocks())
    estimate = estimate_step(simulation.measurement.counts, gpu=GPUS["h100-80gb"])
    fused = [c for c in simulation.measurement.counts.costs if c.compiled_bytes is not None]
    if compiled:
        assert fused and {c.phase for c in fused} >= {"forward", "backward"}
        assert estimate.compute_fused_s < estimate.compute_s < estimate.compute_eager_s
    else:
        assert not fused and estimate.compute_s == estimate.compute_eager_s
