"""``nemo-ac plan`` end to end in one process: a tiny recipe and each flagship at real width, bad input as one line.

The flagships run one block of each kind at real width (what ``--depth scaled`` starts from): the full-depth runs
take a minute each and are measured in docs/planning.md (``benchmarks/plan_flagships.py``), where the scaled and the
full-depth peaks are compared.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from nemo_ac.cli import main as cli
from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.routing import RoutingAssumption
from nemo_ac.simulate.run import SimulationError, SimulationOptions, simulate
from nemo_ac.simulate.scaled import block_kinds, with_blocks

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "recipes/tiny/qwen3_moe_tiny.yaml")
FLAGSHIPS = {
    "qwen3_6": (ROOT / "recipes/qwen3_6_35b_medpix_ep8cp2_4k.yaml", 8),
    "nemotron": (ROOT / "recipes/nemotron_super_v3_te_deepep.yaml", 64),
    "glm": (ROOT / "recipes/glm_4_5_air_cp4_ulysses.yaml", 8),
}


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
    from nemo_ac.models.common import attention

    tiled = attention.ATTENTION_OPS["tiled"]
    monkeypatch.setitem(
        attention.ATTENTION_OPS, "tiled", lambda q, k, v, attn, scale=None: tiled(_fails(q), k, v, attn)
    )
    recipe = load_recipe(TINY, ["dist.device=cpu"])
    layout = validate_recipe(recipe, world_size=2)
    with pytest.raises(SimulationError, match=r"in nemo_ac_test\.fails_under_fake: RuntimeError: this op's fake rule"):
        simulate(recipe, layout, SimulationOptions(world_size=2))


def test_the_sweep_tries_each_memory_lever_the_other_way() -> None:
    from nemo_ac.simulate.sweep import neighbours

    path, _ = FLAGSHIPS["qwen3_6"]
    candidates = {c.label: c.recipe.train for c in neighbours(load_recipe(path))}
    assert candidates["optimizer_offload none"].optimizer_offload == "none"
    assert candidates["loss_chunk_tokens 0"].loss_chunk_tokens == 0
    tiny = {c.label: c.recipe.train for c in neighbours(load_recipe(TINY))}
    assert tiny["optimizer_offload states"].optimizer_offload == "states"
    assert tiny["optimizer_offload full"].optimizer_offload == "full"
    assert candidates["optimizer_offload full"].optimizer_offload == "full"
    assert tiny["loss_chunk_tokens 1024"].loss_chunk_tokens == 1024
    assert tiny["optimizer_state_dtype bfloat16"].optimizer_state_dtype == "bfloat16"
    # Qwen3.6 keeps fp32 moments on the host (offload states): bf16 moments leave that offload, which keeps fp32 ones.
    bf16 = candidates["optimizer_state_dtype bfloat16 (offload none)"]
    assert (bf16.optimizer_state_dtype, bf16.optimizer_offload) == ("bfloat16", "none")
    back = {c.label for c in neighbours(load_recipe(TINY, ["train.optimizer_state_dtype=bfloat16"]))}
    assert "optimizer_state_dtype float32" in back and "optimizer_offload states" not in back


def test_routing_assumption_counts() -> None:
    balanced = RoutingAssumption().expert_counts(rows=10, num_experts=4)
    assert balanced == [3, 3, 2, 2]  # round robin: what force_balanced_routing routes
    hot = RoutingAssumption(imbalance=2.0).expert_counts(rows=400, num_experts=8)
    assert hot[0] == 100 and sum(hot) == 400 and max(hot[1:]) - min(hot[1:]) <= 1


def test_validate_gpu_refuses_a_recipe_that_does_not_fit(capsys: pytest.CaptureFixture) -> None:
    """GLM-4.5-Air on one 8-GPU node with AdamW's states on the device does not fit an H100 (fp32 master weights,
    gradients and AdamW state); the refusal names the largest term and its keys. With the states alone in host
    memory (~117 GiB per rank) it fits an H200, and as the recipe ships (shards, gradients and states on the host)
    the H100."""
    path, world = FLAGSHIPS["glm"]
    on_device = ["train.optimizer_offload=none"]
    assert cli(["validate", str(path), "--world-size", str(world), "--gpu", "h100-80gb", *on_device]) == 2
    err = capsys.readouterr().err
    assert "--gpu" in err and "exceeds" in err and "optimizer states" in err and "parallel.dp_shard" in err
    states = ["train.optimizer_offload=states"]
    assert cli(["validate", str(path), "--world-size", str(world), "--gpu", "h100-80gb", *states]) == 2
    capsys.readouterr()
    assert cli(["validate", str(path), "--world-size", str(world), "--gpu", "h200-141gb", *states]) == 0
    assert "memory | fits h200-141gb" in capsys.readouterr().out
    assert cli(["validate", str(path), "--world-size", str(world), "--gpu", "h100-80gb"]) == 0
    assert "memory | fits h100-80gb" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(FLAGSHIPS))
def test_each_flagship_steps_at_real_width(name: str) -> None:
    """One block of each kind at the real widths, at the recipe's world size (what --depth scaled runs first)."""
    path, world = FLAGSHIPS[name]
    recipe = load_recipe(path)
    order, _ = block_kinds(recipe.model)
    reduced = dataclasses.replace(recipe, model=with_blocks(recipe.model, order))
    simulation = simulate(reduced, validate_recipe(reduced, world_size=world), SimulationOptions(world_size=world))
    m = simulation.measurement
    assert m.counts.without_formula == {}
    states = m.peak.terms.get("optimizer states", 0) + simulation.host_bytes.get("optimizer states", 0)
    assert states > 2**28 and m.counts.flops["forward"] > 1e13  # real widths (states on the device or the host)
    assert m.counts.collectives and simulation.plan.summary_lines()
    kinds = {kind for (_, kind, _) in m.counts.collectives}
    if recipe.backend.dispatcher == "deepep":  # Nemotron: EP64 over 8 nodes, so part of DeepEP's copies cross RDMA
        deepep = [r for (_, kind, _), r in m.counts.collectives.items() if kind == "deepep"]
        assert "all_to_all" not in kinds and deepep
        assert 0 < deepep[0].network_bytes < deepep[0].wire_bytes
    elif recipe.parallel.ep > 1:
        assert "all_to_all" in kinds and "deepep" not in kinds


def test_a_flagship_plans_through_the_cli_depth_scaled(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path, world = FLAGSHIPS["glm"]
    out = tmp_path / "plan.json"
    assert cli(["plan", str(path), "--world-size", str(world), "--depth", "scaled", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "depth scaled" in capsys.readouterr().out
    assert {e["gpu"] for e in report["estimates"]} == {"h100-80gb", "h200-141gb"}
    # 28 GiB per rank with the shards, gradients and AdamW's states in host memory (docs/planning.md): 50 GiB of fp32
    # shards, as many of gradients and 100 GiB of states per rank on the host.
    assert [e["fits"] for e in report["estimates"]] == [True, True]
    host = report["memory"]["host_bytes_per_rank"]
    assert host["optimizer states"] > 90 * 2**30 and host["parameters"] > 45 * 2**30
    assert report["estimates"][0]["host_step_s"] > 0


def test_the_sweep_ranks_the_recipes_neighbours_through_the_cli(capsys: pytest.CaptureFixture) -> None:
    assert cli(["plan", TINY, "--world-size", "2", "--gpu", "h100-80gb", "--sweep"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sweep | ")]
    ranked = [line for line in lines if line[8:11].strip().rstrip(".").isdigit()]
    assert len(ranked) > 3 and any("<- the recipe" in line for line in lines)
    steps = [float(line.split(" step ")[1].split()[0]) for line in ranked if line.split(" step ")[1].split()[1] == "us"]
    assert steps and steps == sorted(steps)


def test_search_overrides_name_every_key_that_changed() -> None:
    from nemo_ac.simulate.sweep import _with, overrides

    recipe = load_recipe(TINY)
    moved = _with(_with(recipe, ep=2, mb=4), reshard=False)
    assert overrides(recipe, moved) == [
        "parallel.ep=2",
        "parallel.fsdp.reshard_after_forward=false",
        "train.micro_batch_size=4",
    ]
    assert overrides(recipe, recipe) == []


def test_one_search_round_moves_to_the_fastest_neighbour_that_fits(capsys: pytest.CaptureFixture) -> None:
    """The search dry-runs each untried neighbour once and ends on the fastest one that fits (no slower than the
    recipe's own layout), and the CLI prints the override line of that layout."""
    from nemo_ac.simulate.gpus import GPUS
    from nemo_ac.simulate.scaled import simulate_scaled
    from nemo_ac.simulate.sweep import overrides, search_layouts

    recipe = load_recipe(TINY)
    options = SimulationOptions(world_size=2)
    gpus = [GPUS["h100-80gb"]]
    base = simulate_scaled(recipe, validate_recipe(recipe, world_size=2), options)
    result = search_layouts(base, gpus=gpus, options=options, max_rounds=1)
    assert result.tried > 5 and len(result.moves) <= 1
    own = result.best if not result.moves else None
    best = result.best.report.estimates[0].step_s
    assert result.best.report.fits[0].fits
    if own is None:  # it moved: to a faster layout, by one change
        assert len(overrides(recipe, result.best.recipe)) >= 1
    from nemo_ac.simulate.report import PlanReport

    assert best <= PlanReport.build(base, gpus).estimates[0].step_s


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
