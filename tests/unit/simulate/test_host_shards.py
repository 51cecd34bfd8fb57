"""``train.optimizer_offload: full`` in the dry run: what leaves the planned GPU, what the host holds, what the step
pays for it (``nemo_ac.simulate.host_shards``), and the counter's view of ops that return nothing (fused AdamW)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.estimate import estimate_step
from nemo_ac.simulate.gpus import GPUS
from nemo_ac.simulate.host_shards import UnitShard, add_host_shard_costs
from nemo_ac.simulate.run import SimulationOptions, simulate

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "recipes/tiny/qwen3_moe_tiny.yaml")
ON_CUDA = ["dist.device=cuda", "dist.backend=nccl"]


def _simulate(overrides: list[str]):
    recipe = load_recipe(TINY, overrides)
    return simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))


@pytest.fixture(scope="module")
def on_device_and_offloaded():
    return _simulate(ON_CUDA), _simulate([*ON_CUDA, "train.optimizer_offload=full"])


def test_full_offload_moves_shards_gradients_and_states_off_the_planned_gpu(on_device_and_offloaded) -> None:
    on_device, offloaded = on_device_and_offloaded
    host = offloaded.host_bytes
    # Every parameter of the tiny recipe trains: one fp32 gradient and two AdamW moments per fp32 shard, plus
    # AdamW's step counter (one fp32 scalar per parameter tensor).
    assert host["parameters"] > 0
    assert host["gradients"] == host["parameters"]
    assert 0 < host["optimizer states"] - 2 * host["parameters"] <= 4 * 64
    assert on_device.host_bytes == {}
    for phase, peak in offloaded.measurement.phase_peaks.items():
        assert "optimizer states" not in peak.terms, (phase, peak.terms)
    # The step's device peak loses the states and the sharded gradients the on-device plan holds then.
    step_on_device = on_device.measurement.phase_peaks["optimizer"]
    step_offloaded = offloaded.measurement.phase_peaks["optimizer"]
    assert step_on_device.terms["optimizer states"] == host["optimizer states"]
    assert step_offloaded.peak_bytes <= step_on_device.peak_bytes - host["optimizer states"] - host["gradients"]
    staging = [h for h in offloaded.measurement.peak.hand_added if h.term == "host shard staging"]
    assert len(staging) == 1 and 0 < staging[0].bytes < host["parameters"]
    assert "optimizer_offload full" in " ".join(offloaded.assumptions)
    assert "sharded parameters + gradients + optimizer on host" in offloaded.plan.summary_lines()[1]


def test_full_offload_pays_the_host_link_and_the_host_step(on_device_and_offloaded) -> None:
    on_device, offloaded = on_device_and_offloaded
    gpu = GPUS["h100-80gb"]
    before = estimate_step(on_device.measurement.counts, gpu=gpu)
    after = estimate_step(offloaded.measurement.counts, gpu=gpu)
    assert before.host_step_s == before.host_overlapped_s == before.host_exposed_s == 0
    # 2 micro batches per step: the second one's gradient copy is waited for and added on the CPU.
    assert after.host_step_s > 0 and after.host_overlapped_s > 0 and after.host_exposed_s > 0
    assert after.step_s >= max(after.compute_s, after.overlapped_s) + after.host_step_s
    moved = {cost.name for cost in offloaded.measurement.counts.costs if cost.link}
    assert {"fsdp_shard_h2d", "fsdp_grad_d2h", "host_grad_accumulate", "_fused_adamw_"} <= moved


def test_host_shard_costs_follow_the_unshards_and_reductions() -> None:
    """Per micro batch: every unit's shard is copied at the forward unshard, non-root units again in backward;
    the first reduction's gradient copy overlaps, later ones block and are added on the host."""
    from nemo_ac.simulate.counters import StepCounts

    counts = StepCounts()
    units = [UnitShard(bytes=100, trainable_bytes=100, root=False), UnitShard(bytes=10, trainable_bytes=0, root=True)]
    add_host_shard_costs(
        counts, units, micro_batches=4, reductions=4, reshard_after_forward=True, reduce_dtype="float32"
    )
    by_link: dict[str, int] = {}
    for cost in counts.costs:
        by_link[cost.link] = by_link.get(cost.link, 0) + cost.weight * cost.bytes
    assert by_link["host"] == 4 * 110 + 4 * 100 + 100
    assert by_link["host_blocking"] == 3 * 100
    assert by_link["host_memory"] == 3 * 3 * 100
