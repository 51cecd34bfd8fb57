"""Ring CP over the recurrent mixers (state passing: Mamba-2 in Nemotron-H, Gated DeltaNet in Qwen3.6) equals one
process: the op in fp64 on 2 and 4 gloo ranks, and the tiny recipes through the parity harness (``tests.parity``:
step-1 gradients per parameter and every step's loss) with ring cp2 on 2 ranks and cp2 x ep2 on 4 ranks.

- op level (``workers/state_passing_cp.py``): outputs, input and parameter gradients of ``ring_linear_attention``
  and ``ring_ssm`` against the single-sequence ops at 1e-10, documents crossing every rank boundary, one starting
  exactly at a slice start, padding, slices not a multiple of the chunk;
- recipe level (``workers/parity.py``, one launch per world size): the tiny Nemotron (selective AC, EP2, explicit
  prefetch, eager as the recipe ships) and the tiny Qwen3.6 MedPix recipe (selective AC, EP2, with Dynamo on the
  aot_eager backend in the 2-rank cell: the state-passing op traced into the block's graph, no recompile after step
  2; inductor is the recipe's default and takes minutes to compile on 2 cores). Rows pack documents across the CP
  slice boundaries (the text corpus' documents and MedPix samples run across slices).
"""

from __future__ import annotations

import re

import pytest

from tests.launch import ROOT, run_script
from tests.parity import (
    TOLERANCES,
    assert_parity,
    max_relative_loss_difference,
    relative_gradient_differences,
    run_parity_cells,
)

pytestmark = pytest.mark.functional

OP_WORKER = ROOT / "tests" / "functional" / "workers" / "state_passing_cp.py"
NEMOTRON = "tiny/nemotron_super_v3_tiny.yaml"
QWEN = "tiny/qwen3_6_medpix_tiny.yaml"
STEPS = ["train.steps=3"]
RING = ["parallel.cp=2", "parallel.cp_type=ring"]
QWEN_EAGER = ["compile.enabled=false"]
QWEN_WS1 = ["parallel.cp=1", "parallel.ep=1", "train.micro_batch_size=2", *QWEN_EAGER]
# Gated DeltaNet's decay parameters: their fp32 gradient (a sum over tokens of dL/dg * g that cancels) moves by
# ~0.5% with the chunk boundaries alone, in one process (qwen_ws1_chunk40 against qwen_ws1). The ring's slices cut
# chunks elsewhere, so these are held to the control's deviation, every other parameter to 1e-5.
CHUNKING_SENSITIVE = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")

# world size -> {cell: (recipe, overrides)}; ``micro_batch_size * dp`` is equal within a recipe, so every micro step
# covers the same rows as the reference (the ws1 cell of the same recipe).
CELLS: dict[int, dict[str, tuple[str, list[str]]]] = {
    1: {
        "nemotron_ws1": (NEMOTRON, ["parallel.ep=1", "train.micro_batch_size=4"]),
        "qwen_ws1": (QWEN, QWEN_WS1),
        # The control: one process, only the chunking changed (40 = the ring's slice length instead of 64).
        "qwen_ws1_chunk40": (QWEN, [*QWEN_WS1, "model.linear_attention.chunk_size=40"]),
    },
    2: {
        "nemotron_cp2_ring_ep2": (NEMOTRON, [*RING, "train.micro_batch_size=4"]),
        "qwen_cp2_ring_compiled": (
            QWEN,
            [*RING, "parallel.ep=1", "train.micro_batch_size=2", "compile.backend=aot_eager", "train.steps=4"],
        ),
    },
    4: {
        "nemotron_cp2_ring_x_ep2": (NEMOTRON, [*RING, "parallel.ep=2", "train.micro_batch_size=2"]),
        "qwen_cp2_ring_x_ep2": (QWEN, [*RING, "parallel.ep=2", "train.micro_batch_size=1", *QWEN_EAGER]),
    },
}
REFERENCE = {NEMOTRON: "nemotron_ws1", QWEN: "qwen_ws1"}


@pytest.mark.parametrize("nproc", [2, 4])
def test_state_passing_ops_equal_the_full_sequence_op_in_fp64(nproc: int) -> None:
    proc = run_script(OP_WORKER, nproc=nproc, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # findall, not lines: two ranks' prints can share a line (each print writes its text, then its newline)
    diffs = [float(d) for d in re.findall(r"max_abs_diff=(\d\.\d+e[+-]\d+)", proc.stdout)]
    assert len(diffs) == nproc * (1 + 5 + 3 + 1 + 4 + 8), out[-3000:]  # every check ran on every rank
    print(f"\nstate passing fp64 | {nproc} ranks | max abs diff {max(diffs):.2e}")


def _launch(world_size: int, out_dir) -> dict[str, dict]:
    cells = [
        {"name": name, "recipe": recipe, "overrides": [*STEPS, *overrides]}
        for name, (recipe, overrides) in CELLS[world_size].items()
    ]
    return run_parity_cells(cells, world_size=world_size, out_dir=out_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for world_size in CELLS:
        merged.update(_launch(world_size, tmp_path_factory.mktemp(f"ring_recurrent_ws{world_size}")))
    return merged


@pytest.mark.parametrize("name", [n for ws, cells in CELLS.items() if ws > 1 for n in cells], ids=str)
def test_ring_cp_over_recurrent_layers_matches_one_process(runs, name: str) -> None:
    cell = runs[name]
    recipe = CELLS[cell["world_size"]][name][0]
    reference = runs[REFERENCE[recipe]]
    assert any("state-passing ring cp2" in line for line in cell["plan"]), cell["plan"]
    steps = len(reference["losses"])
    tolerance = TOLERANCES["float32"]
    if recipe == NEMOTRON:
        grad, loss = assert_parity(
            name=name,
            grads=cell["grads"],
            losses=cell["losses"][:steps],
            reference_grads=reference["grads"],
            reference_losses=reference["losses"],
            tolerance=tolerance,
        )
        print(f"\nparity | {name} | {cell['world_size']} ranks | grad {grad:.2e} | loss {loss:.2e}")
        return
    diffs = relative_gradient_differences(cell["grads"], reference["grads"])
    control = relative_gradient_differences(runs["qwen_ws1_chunk40"]["grads"], reference["grads"])
    sensitive = {n for n, d in control.items() if d > tolerance.grad}
    assert sensitive and all(n.endswith(CHUNKING_SENSITIVE) for n in sensitive), sorted(sensitive)
    for n, d in diffs.items():
        bound = 2 * control[n] if n in sensitive else tolerance.grad
        assert d <= bound, f"{name}: gradient of {n} off by {d:.3g} relative (> {bound:.3g})"
    loss = max_relative_loss_difference(cell["losses"][:steps], reference["losses"])
    assert loss <= tolerance.loss, (cell["losses"], reference["losses"])
    rest = max(d for n, d in diffs.items() if n not in sensitive)
    worst = max(sensitive, key=diffs.get)
    print(
        f"\nparity | {name} | {cell['world_size']} ranks | grad {rest:.2e} (decay params: {diffs[worst]:.2e}, "
        f"one-process chunk-40 control {control[worst]:.2e}) | loss {loss:.2e}"
    )


def test_the_compiled_state_passing_block_does_not_recompile(runs) -> None:
    per_step = runs["qwen_cp2_ring_compiled"]["compiles_per_step"]
    assert sum(per_step[0].values()) >= 2, per_step  # both decoder blocks went through Dynamo
    assert per_step[2:] == [per_step[1]] * (len(per_step) - 2), per_step
