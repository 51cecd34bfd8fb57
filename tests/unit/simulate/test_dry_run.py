"""``nemo-ac plan`` end to end in one process on the tiny recipe: every section printed, the planned device's AdamW
kernel, depth scaling, bad input as one line (the flagships: test_flagship_plans.py; sweep and search:
test_layout_search.py)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch

from nemo_ac.cli import main as cli
from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.routing import RoutingAssumption
from nemo_ac.simulate.run import SimulationError, SimulationOptions, simulate
from tests.factories import FLAGSHIPS_AT_WORLD_SIZE as FLAGSHIPS
from tests.factories import TINY_PLAN_RECIPE as TINY


def test_tiny_plan_prints_every_section_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    assert cli(["plan", TINY, "--world-size", "2", "--gpu", "h100-80gb", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for head in ("memory | peak", "flops |", "comm | ", "estimate | h100-80gb: step", "assumes |", "dry run |"):
        assert head in text, head
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["memory"]["peak_bytes"] > 0
    assert report["flops"]["total"] == sum(
        report["flops"][p] for p in ("forward", "backward", "recompute", "optimizer")
    )
    assert report["estimates"][0]["estimate"] is True and report["estimates"][0]["fits"] is True
    assert report["ops_without_formula"] == {}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_dry_run_steps_the_adamw_kernel_of_the_planned_device(device: str) -> None:
    """The built-in AdamW is fused on CUDA (no foreach temporaries) and foreach on CPU; the dry run plans with the
    one that will run, so a CUDA plan's optimizer step allocates nothing beyond the states."""
    backend = "nccl" if device == "cuda" else "gloo"
    recipe = load_recipe(TINY, [f"dist.device={device}", f"dist.backend={backend}"])
    simulation = simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))
    step = simulation.measurement.phase_peaks["optimizer"].terms
    kernel = "fused" if device == "cuda" else "foreach"
    assert f"built-in AdamW {kernel}, the kernel it runs on {device}" in " ".join(simulation.assumptions)
    if device == "cuda":
        assert "optimizer step temporaries" not in step, step
    else:  # foreach: a temporary list as large as the fp32 parameters (the check can fail)
        assert step["optimizer step temporaries"] >= step["parameters"] // 2, step


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--world-size", "2", "--gpu", "v100-16gb"], "--gpu"),
        (["--world-size", "3", "parallel.dp_shard=2"], "parallel"),
        (["--world-size", "2", "--imbalance", "0.5", "parallel.ep=2"], "--imbalance"),
        (["--world-size", "2", "--micro-batches", "zero"], "--micro-batches"),
        (["--world-size", "2", "--host-memory", "0"], "--host-memory"),
        ([], "--world-size"),  # dp_shard -1: the recipe fixes no world size
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], key: str, capsys: pytest.CaptureFixture) -> None:
    assert cli(["plan", TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and key in err, err
    if key.startswith("--"):  # the command's own arguments: one line
        assert "\n" not in err and err.startswith(f"nemo-ac plan: {key}"), err


@torch.library.custom_op("nemo_ac_test::fails_under_fake", mutates_args=())
def _fails(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_fails.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this op's fake rule cannot say its output shape")


def test_a_fake_mode_failure_inside_a_custom_op_names_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_ac.models.layers import attention

    tiled = attention.ATTENTION_OPS["tiled"]
    monkeypatch.setitem(
        attention.ATTENTION_OPS, "tiled", lambda q, k, v, attn, scale=None: tiled(_fails(q), k, v, attn)
    )
    recipe = load_recipe(TINY, ["dist.device=cpu"])
    layout = validate_recipe(recipe, world_size=2)
    with pytest.raises(SimulationError, match=r"in nemo_ac_test\.fails_under_fake: RuntimeError: this op's fake rule"):
        simulate(recipe, layout, SimulationOptions(world_size=2))


def test_routing_assumption_counts() -> None:
    balanced = RoutingAssumption().expert_counts(rows=10, num_experts=4)
    assert balanced == [3, 3, 2, 2]  # round robin: what force_balanced_routing routes
    hot = RoutingAssumption(imbalance=2.0).expert_counts(rows=400, num_experts=8)
    assert hot[0] == 100 and sum(hot) == 400 and max(hot[1:]) - min(hot[1:]) <= 1


@pytest.mark.parametrize("reshard", [True, False])
def test_depth_scaling_keeps_every_units_gathered_parameters_without_reshard(reshard: bool) -> None:
    """Without reshard after forward each unit's gathered parameters live from its forward to its backward, so the
    scaled peak must grow them with depth: at 6 layers the scaled and the full-depth peaks agree either way (counted
    as one unit's, the no-reshard scaled peak fell short by 4 units' gathered parameters)."""
    from nemo_ac.simulate.scaled import simulate_scaled

    overrides = ["model.num_layers=6", f"parallel.fsdp.reshard_after_forward={str(reshard).lower()}"]
    recipe = load_recipe(TINY, overrides)
    layout = validate_recipe(recipe, world_size=2)
    options = SimulationOptions(world_size=2)
    full = simulate(recipe, layout, options).measurement.peak
    scaled = simulate_scaled(recipe, layout, options).measurement.peak
    assert scaled.terms.get("gathered parameters") == full.terms.get("gathered parameters")
    assert scaled.peak_bytes == pytest.approx(full.peak_bytes, rel=0.02)


def test_depth_scaling_holds_each_added_blocks_activations_at_the_backward_peak() -> None:
    """Scaling adds a second block of a kind *before* the others, so its saved activations are held through the whole
    backward of the rest, as every block but the first processed is at a full-depth backward peak. Added after them,
    its backward came first and the peak could stay where the base run had it: Nemotron Super with its Mamba-2 blocks
    uncheckpointed (``by_block.ssm=none``, Automodel's benchmark shape) scaled to 58.6 GiB per rank against the full
    depth's 120.9, and the layout search took layouts that did not fit for ones that did. Here at real width and 8
    blocks (seconds): the old order scaled to 13.5 GiB against the full depth's 17.8 (at 88 blocks the scaled peak
    is within 0.1% of the full one)."""
    from nemo_ac.simulate.scaled import simulate_scaled

    path, world = FLAGSHIPS["nemotron"]
    shape = ["data.seq_len=4096", "train.global_batch_size=512", "train.micro_batch_size=2"]
    blocks = ["model.num_layers=8", "model.layer_pattern=MEMEM*EM"]
    recipe = load_recipe(path, [*shape, *blocks, "activation_checkpointing.by_block.ssm=none"])
    layout = validate_recipe(recipe, world_size=world)
    options = SimulationOptions(world_size=world)
    full = simulate(recipe, layout, options).measurement.peak
    scaled = simulate_scaled(recipe, layout, options).measurement.peak
    assert full.terms["activations"] <= scaled.terms["activations"]
    assert full.peak_bytes <= scaled.peak_bytes <= 1.15 * full.peak_bytes


@pytest.mark.parametrize("compiled", [True, False])
def test_deepeps_async_transfers_run_behind_the_shared_expert(compiled: bool) -> None:
    """Nemotron Super at real width (8 blocks, Automodel's shape): compiled inside their checkpoints, the MoE blocks
    call DeepEP between compiled graphs, where every transfer is asynchronous. The dry run finds each one's arrival
    after one of the shared expert's GEMMs: the forward's dispatch behind the up-projection, its combine behind the
    down-projection, and in backward each of the two transfers behind one of their gradient GEMMs (the recompute's
    transfers are asynchronous too, with the saved GEMMs replayed between); the estimate takes that compute off the
    blocking time. Without compile the transfers are synchronous:
    nothing is hidden."""
    from nemo_ac.simulate.estimate import estimate_step
    from nemo_ac.simulate.gpus import GPUS

    path, world = FLAGSHIPS["nemotron"]
    shape = ["data.seq_len=4096", "train.global_batch_size=512", "train.micro_batch_size=2"]
    blocks = ["model.num_layers=8", "model.layer_pattern=MEMEM*EM", f"compile.enabled={str(compiled).lower()}"]
    recompute_dispatch = ["activation_checkpointing.selective.save_communication=false"]  # the recompute dispatches
    recipe = load_recipe(path, [*shape, *blocks, *recompute_dispatch])
    simulation = simulate(recipe, validate_recipe(recipe, world_size=world), SimulationOptions(world_size=world))
    counts = simulation.measurement.counts
    tokens = 2 * 4096
    shared_up = 2 * tokens * recipe.model.hidden_size * recipe.model.moe.shared_expert_intermediate_size
    moe_blocks = recipe.model.layer_pattern.count("E")
    async_calls = [call for call in counts.calls if call.read_at is not None]
    estimate = estimate_step(counts, gpu=GPUS["h100-80gb"])
    if not compiled:
        assert not async_calls and estimate.comm_overlap_s == 0
        return
    assert {call.kind for call in async_calls} == {"deepep"}
    phases = collections.Counter(call.phase for call in async_calls)
    runs = phases["forward"] // (2 * moe_blocks)  # micro batches the dry run ran: a dispatch and a combine each
    assert runs >= 1 and phases == {"forward": 2 * moe_blocks * runs, "recompute": 2 * moe_blocks * runs,
                                    "backward": 2 * moe_blocks * runs}  # fmt: skip
    behind_a_shared_gemm = [
        call for call in async_calls
        if any(cost.name == "mm" and cost.flops == shared_up for cost in counts.costs[call.at : call.read_at])
    ]  # fmt: skip
    # The shared expert's up and down projections (the same FLOPs); the selective recompute replays saved GEMMs.
    assert behind_a_shared_gemm == [call for call in async_calls if call.phase != "recompute"]
    blocking = [call for call in counts.calls if call.kind == "deepep" and call.read_at is None]
    assert not blocking, blocking
    assert 0 < estimate.comm_overlap_s < estimate.exposed_s
