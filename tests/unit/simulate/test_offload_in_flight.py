"""``activation_checkpointing.offload_in_flight`` in the dry run of a GPU plan: the device holds each block's
offloaded tensors until its window closes (the most a run can hold), and the copies back that are not prefetched
are on the compute stream (``distributed.offload``, ``simulate.counters``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.estimate import estimate_step
from nemo_ac.simulate.gpus import GPUS
from nemo_ac.simulate.run import SimulationOptions, simulate

ROOT = Path(__file__).resolve().parents[3]
GLM_TINY = str(ROOT / "recipes/tiny/glm_4_5_air_tiny.yaml")  # full AC + offload, 2 ranks of Ulysses CP
LAYERS = 5


def _simulate(in_flight: int):
    recipe = load_recipe(
        GLM_TINY,
        [
            "dist.device=cuda",
            "dist.backend=nccl",
            f"model.num_layers={LAYERS}",
            "train.optimizer_offload=none",
            f"activation_checkpointing.offload_in_flight={in_flight}",
        ],
    )
    return simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))


@pytest.fixture(scope="module")
def by_in_flight():
    return {n: _simulate(n) for n in (1, 3)}


def test_each_block_in_flight_holds_one_more_block_input_in_forward(by_in_flight) -> None:
    """Full AC offloads one input per block; the forward's peak holds ``in_flight`` of them (the running block's
    and those before it whose copies may still be reading them)."""
    one, three = by_in_flight[1], by_in_flight[3]
    assert one.host_bytes == three.host_bytes
    per_block = one.host_bytes["offloaded activations"] // LAYERS
    assert per_block > 0
    grown = (
        three.measurement.phase_peaks["forward"].terms["activations"]
        - one.measurement.phase_peaks["forward"].terms["activations"]
    )
    assert grown == 2 * per_block
    assert "at most 3 blocks of offloaded tensors on the device" in " ".join(three.assumptions)
    assert "offload: 3 blocks in flight" in three.plan.summary_lines()[1]


def test_copies_back_not_prefetched_are_on_the_critical_path(by_in_flight) -> None:
    """``in_flight`` 1: every copy back waits on the compute stream; 3: only the first block in backward does
    (nothing before it to overlap with), so the exposed host-link time is a fifth of it with five blocks."""
    gpu = GPUS["h100-80gb"]
    one = estimate_step(by_in_flight[1].measurement.counts, gpu=gpu)
    three = estimate_step(by_in_flight[3].measurement.counts, gpu=gpu)
    assert one.host_exposed_s > 0
    assert three.host_exposed_s == pytest.approx(one.host_exposed_s / LAYERS)
    # The same bytes cross the link either way: what is not exposed is overlapped.
    assert one.host_overlapped_s + one.host_exposed_s == pytest.approx(three.host_overlapped_s + three.host_exposed_s)
    assert "4 of the 5 copies back the dry run made prefetched" in " ".join(by_in_flight[3].assumptions)
