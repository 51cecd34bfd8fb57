"""``nemo-ac plan --sweep`` and ``--search`` on the tiny recipe: the neighbours each lever gives, their ranking through
the CLI, and one round of the search's hill climb."""

from __future__ import annotations

import dataclasses

import pytest

from nemo_ac.cli import main as cli
from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.run import SimulationOptions
from tests.factories import FLAGSHIPS_AT_WORLD_SIZE as FLAGSHIPS
from tests.factories import TINY_PLAN_RECIPE as TINY


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
    assert tiny["optimizer_state_dtype float8"].optimizer_state_dtype == "float8"
    back = {c.label for c in neighbours(load_recipe(TINY, ["train.optimizer_state_dtype=bfloat16"]))}
    assert {"optimizer_state_dtype float32", "optimizer_state_dtype float8"} <= back
    assert "optimizer_offload states" not in back


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


def test_the_search_moves_the_offload_bound_where_activations_are_offloaded() -> None:
    """One block more or fewer in flight, within 1 .. MOST_OFFLOAD_IN_FLIGHT, and only where activations offload;
    the override line names the key."""
    from nemo_ac.simulate.sweep import MOST_OFFLOAD_IN_FLIGHT, neighbours, overrides

    path, _ = FLAGSHIPS["glm"]
    recipe = load_recipe(path)  # full AC + offload, the default bound (2)
    moves = {c.label: c.recipe for c in neighbours(recipe, search=True) if c.label.startswith("offload_in_flight")}
    assert sorted(moves) == ["offload_in_flight 1", "offload_in_flight 3"]
    assert overrides(recipe, moves["offload_in_flight 3"]) == ["activation_checkpointing.offload_in_flight=3"]
    top = load_recipe(path, [f"activation_checkpointing.offload_in_flight={MOST_OFFLOAD_IN_FLIGHT}"])
    assert {c.label for c in neighbours(top, search=True)} >= {f"offload_in_flight {MOST_OFFLOAD_IN_FLIGHT - 1}"}
    assert f"offload_in_flight {MOST_OFFLOAD_IN_FLIGHT + 1}" not in {c.label for c in neighbours(top, search=True)}
    assert not [c for c in neighbours(load_recipe(TINY), search=True) if c.label.startswith("offload_in_flight")]


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


def test_worker_processes_give_the_reports_one_process_gives() -> None:
    """``--jobs 2``: candidates dry-run in two spawned workers get the reports one process gives them (the same
    estimates, peaks and rejections, in the candidates' order), so a round moves to the same layout. Two layouts
    and a rejected one: enough to see the order kept, few dry runs for CI's time."""
    from nemo_ac.simulate.gpus import GPUS
    from nemo_ac.simulate.sweep import _evaluate_all, neighbours, worker_pool

    recipe = load_recipe(TINY)
    options = SimulationOptions(world_size=2)
    gpus = [GPUS["h100-80gb"]]
    picked = neighbours(recipe, search=True)[1:3]
    invalid = dataclasses.replace(picked[0], label="ep 3", recipe=load_recipe(TINY, ["parallel.ep=3"]))

    def reports(pool) -> list[tuple]:
        candidates = [dataclasses.replace(c) for c in [*picked, invalid]]
        _evaluate_all(candidates, world=2, gpus=gpus, options=options, pool=pool)
        return [
            (c.label, c.rejected[:40], c.report and (c.report.estimates[0].step_s, c.report.fits[0].peak_bytes))
            for c in candidates
        ]

    alone = reports(None)
    with worker_pool(2) as pool:
        assert reports(pool) == alone
    assert [bool(report) for *_, report in alone] == [True, True, False]


def test_the_search_moves_one_block_kinds_ac_mode_and_names_it_in_the_override_line() -> None:
    """The search's AC moves per block kind (``activation_checkpointing.by_block``): toward less recompute while the
    layout fits, toward more while it does not; the override line it prints loads back into the same recipe."""
    from nemo_ac.simulate.sweep import layout_key, neighbours, overrides

    path, full = NEMOTRON_TINY, ["activation_checkpointing.mode=full"]  # the flagship's kinds, full AC on each
    recipe = load_recipe(path, full)
    kinds = ("ssm", "moe", "softmax_attention")

    def moves(candidates: list) -> dict[str, dict[str, str]]:
        return {c.label: c.recipe.activation_checkpointing.by_block for c in candidates
                if c.label.startswith("AC ") and len(c.label.split()) == 3}  # fmt: skip

    lighter = moves(neighbours(recipe, search=True, block_kinds=kinds))
    assert lighter["AC ssm selective"] == {"ssm": "selective"}
    # A selective block may keep its dispatch buffers or recompute the collectives: both in one move.
    both = next(c.recipe for c in neighbours(recipe, search=True, block_kinds=kinds)
                if c.label == "AC moe selective, collectives recomputed")  # fmt: skip
    assert both.activation_checkpointing.by_block == {"moe": "selective"}
    assert overrides(recipe, both) == [
        "activation_checkpointing.selective.save_communication=false",
        f"{BY_BLOCK}.moe=selective",
    ]
    # Larger micro batches while the selective blocks stop saving their dispatch buffers: one move too.
    selective = load_recipe(path, [*full, f"{BY_BLOCK}.moe=selective"])
    bigger = next(c.recipe for c in neighbours(selective, search=True, block_kinds=kinds)
                  if c.label == f"mb {selective.train.micro_batch_size * 2}, collectives recomputed")  # fmt: skip
    assert overrides(selective, bigger) == [
        "activation_checkpointing.selective.save_communication=false",
        f"train.micro_batch_size={selective.train.micro_batch_size * 2}",
    ]
    assert lighter["AC moe none"] == {"moe": "none"}
    assert "AC ssm full" not in lighter
    assert not moves(neighbours(recipe, block_kinds=kinds))  # the sweep keeps its one-key moves
    heavier = moves(neighbours(load_recipe(path, [*full, f"{BY_BLOCK}.ssm=selective"]), search=True,
                               block_kinds=kinds, lighter=False))  # fmt: skip
    assert heavier == {"AC ssm full": {}}  # back to the recipe's mode: the key leaves by_block

    moved = next(c.recipe for c in neighbours(recipe, search=True, block_kinds=kinds) if c.label == "AC ssm selective")
    line = overrides(recipe, moved)
    assert line == [f"{BY_BLOCK}.ssm=selective"]
    assert layout_key(load_recipe(path, [*full, *line])) == layout_key(moved) != layout_key(recipe)
    # A mode move on top of a by_block key: the kind keeps its own mode unless the line says otherwise.
    own = load_recipe(path, [*full, f"{BY_BLOCK}.moe=none"])
    everywhere = next(c.recipe for c in neighbours(own) if c.label == "AC selective")  # every block selective
    line = overrides(own, everywhere)
    assert line == ["activation_checkpointing.mode=selective", f"{BY_BLOCK}.moe=selective"]
    assert layout_key(load_recipe(path, [*full, f"{BY_BLOCK}.moe=none", *line])) == layout_key(everywhere)


BY_BLOCK = "activation_checkpointing.by_block"
NEMOTRON_TINY = str(TINY).replace("qwen3_moe_tiny", "nemotron_super_v3_tiny")


def test_the_searchs_answer_is_dry_run_at_full_depth_before_it_is_offered(capsys: pytest.CaptureFixture) -> None:
    """The search ranks depth-scaled peaks, an extrapolation; its answer is dry-run again at full depth and refused
    (exit 1) when that peak does not fit the GPU."""
    import dataclasses

    from nemo_ac.simulate.gpus import GPUS
    from nemo_ac.simulate.sweep import Candidate, _check_at_full_depth

    best = Candidate("the recipe", load_recipe(TINY), own=True)
    options = SimulationOptions(world_size=2)
    assert _check_at_full_depth(best, world=2, gpus=[GPUS["h100-80gb"]], options=options) == 0
    assert "checked at full depth:" in capsys.readouterr().out
    small = dataclasses.replace(GPUS["h100-80gb"], name="h100-1mb", memory_bytes=2**20)
    assert _check_at_full_depth(best, world=2, gpus=[small], options=options) == 1
    assert "DOES NOT FIT h100-1mb" in capsys.readouterr().out


def test_an_answer_that_does_not_fit_at_full_depth_gives_way_to_the_round_before(
    capsys: pytest.CaptureFixture,
) -> None:
    """The search's last move is offered only once a full-depth dry run fits it; a depth-scaled peak that was too low
    (here: a move whose report is the recipe's) gives way to the layout of the round before, the recipe."""
    import dataclasses

    from nemo_ac.simulate.gpus import GPUS, RESERVED_BYTES
    from nemo_ac.simulate.report import PlanReport
    from nemo_ac.simulate.run import simulate
    from nemo_ac.simulate.sweep import Candidate, SearchResult, _with, offer

    recipe = load_recipe(TINY)  # micro batches of 1 row: 1.6 MB per rank; of 4 rows: 3.6 MB
    options = SimulationOptions(world_size=2)
    base = simulate(recipe, validate_recipe(recipe, world_size=2), options)
    gpu = dataclasses.replace(GPUS["h100-80gb"], name="h100-2.5mb", memory_bytes=RESERVED_BYTES + 5 * 2**19)
    report = PlanReport.build(base, [gpu])
    assert report.fits[0].fits
    moved = Candidate("mb 4", _with(recipe, mb=4), report=report)  # as if scaling had said it fits
    result = SearchResult(best=moved, moves=[moved], tried=2, wall_s=0.0)
    assert offer(base, result, gpus=[gpu], options=options) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("search | ")]
    assert lines[1] == "search | overrides: train.micro_batch_size=4"
    assert "DOES NOT FIT h100-2.5mb" in lines[2]
    assert lines[4] == "search | overrides: (the recipe as it is)"
    assert "fits h100-2.5mb" in lines[5] and "DOES NOT" not in lines[5]


def test_jobs_below_one_is_refused_naming_the_flag(capsys: pytest.CaptureFixture) -> None:
    from nemo_ac.cli import main

    assert main(["plan", str(TINY), "--world-size", "2", "--search", "--jobs", "0"]) != 0
    assert "--jobs: 0: give a number of processes >= 1" in capsys.readouterr().err
