"""Each flagship planned at real width: one block of each kind at the recipe's world size (what ``--depth scaled``
starts from), the CLI's depth-scaled plan and ``validate --gpu``'s refusal of a layout that does not fit.

The full-depth runs take a minute each and are measured in docs/planning.md (``benchmarks/plan_flagships.py``), where
the scaled and the full-depth peaks are compared.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nemo_ac.cli import main as cli
from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.run import SimulationOptions, simulate
from nemo_ac.simulate.scaled import block_kinds, with_blocks
from tests.factories import FLAGSHIPS_AT_WORLD_SIZE as FLAGSHIPS


def test_validate_gpu_refuses_a_recipe_that_does_not_fit(capsys: pytest.CaptureFixture) -> None:
    """GLM-4.5-Air on one 8-GPU node with AdamW's states on the device does not fit an H100 (fp32 master weights,
    gradients and AdamW state); the refusal names the largest term and its keys. With the states alone in host
    memory (~117 GiB per rank) it fits an H200. (As the recipe ships, shards, gradients and states on the host, it
    fits the H100: test_a_flagship_plans_through_the_cli_depth_scaled.)"""
    path, world = FLAGSHIPS["glm"]
    on_device = ["train.optimizer_offload=none"]
    assert cli(["validate", str(path), "--world-size", str(world), "--gpu", "h100-80gb", *on_device]) == 2
    err = capsys.readouterr().err
    assert "--gpu" in err and "exceeds" in err and "optimizer states" in err and "parallel.dp_shard" in err
    states = ["train.optimizer_offload=states"]
    assert cli(["validate", str(path), "--world-size", str(world), "--gpu", "h200-141gb", *states]) == 0
    assert "memory | fits h200-141gb" in capsys.readouterr().out


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
