"""The dry run against real gloo runs of the same step: the four tiny recipes at their own layouts, HSDP 2x2 and
ring cp2, the first and the last rank (every rank: ``benchmarks/plan_accuracy.py``). Per rank: predicted peak within 10% of the measured one (the same tracker, FSDPMemTracker, in
real mode), predicted FLOPs within 1% of FlopCounterMode over the real step, collective bytes exactly equal, and
the host memory (the tiny GLM recipe's FSDP shards, gradients and AdamW states, ``train.optimizer_offload: full``;
AdamW's states alone in the Qwen3.6 tiny recipe and the GLM one with ``states``; offloaded activations) equal by term.

Both sides run with ``model.moe.force_balanced_routing`` (the dry run's default routing assumption, so expert
parallel moves the same rows) and without torch.compile (the dry run counts the eager op stream), but for one case
compiled with aot_eager, whose measured step must have compiled its blocks (``measure.compile_before_counting``).
``benchmarks/plan_accuracy.py`` prints the same comparison as a table.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.accuracy import ACCURACY_CASES, ACCURACY_OVERRIDES, compare, read_measured
from nemo_ac.simulate.run import SimulationOptions, simulate
from tests.launch import RECIPES, child_env, torchrun_command

pytestmark = pytest.mark.functional

COMMON = list(ACCURACY_OVERRIDES)
CASES = ACCURACY_CASES

WORKER = Path(__file__).parent / "workers" / "plan_accuracy.py"


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One real step of every case (``nemo_ac.simulate.measure``'s), one torchrun launch per world size."""
    root = tmp_path_factory.mktemp("measured")
    out = {name: root / name for name in CASES}
    for nproc in sorted({nproc for _, nproc, _ in CASES.values()}):
        cases = [
            {"recipe": str(RECIPES / recipe), "overrides": [*COMMON, *overrides], "out": str(out[name])}
            for name, (recipe, n, overrides) in CASES.items()
            if n == nproc
        ]
        listing = root / f"cases_{nproc}.json"
        listing.write_text(json.dumps(cases))
        command = torchrun_command(nproc, [str(WORKER), str(listing)])
        done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=900, cwd=root)
        assert done.returncode == 0, f"{nproc} ranks: measured runs failed:\n{(done.stdout + done.stderr)[-4000:]}"
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_dry_run_predicts_every_rank_of_the_real_step(name: str, measured: dict[str, Path]) -> None:
    recipe_path, nproc, overrides = CASES[name]
    recipe = load_recipe(RECIPES / recipe_path, [*COMMON, *overrides])
    layout = validate_recipe(recipe, world_size=nproc)
    for rank in sorted({0, nproc - 1}):  # every rank: benchmarks/plan_accuracy.py
        simulation = simulate(recipe, layout, SimulationOptions(world_size=nproc, micro_batch_limit=None, rank=rank))
        result = compare(simulation, read_measured(measured[name], rank))
        print(result.line())
        assert abs(result.peak_ratio - 1) <= 0.10, result.line()
        assert result.measured_flops == result.flop_counter_flops  # nemo_ac's count is FlopCounterMode's
        assert abs(result.flops_ratio - 1) <= 0.01, result.line()
        assert result.collectives_equal, result.line()
        # Host memory (offloaded AdamW states, offloaded activations), by term, as the real step kept it.
        assert result.predicted_host == result.measured_host, result.line()
        # A compiled case's timed steps ran compiled blocks: Dynamo compiles nothing first called under a counter.
        compiles = read_measured(measured[name], rank)["compile"]["compiles_fwd"]
        assert (compiles > 0) == ("compile.enabled=true" in overrides), (name, compiles)
