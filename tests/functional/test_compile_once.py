"""Compile once: every tiny recipe's first 4 compiled steps on gloo ranks, with no automatic-dynamic recompile and no
recompile at all after the first compile of each block layout.

A size that varies between steps and reaches a compiled frame undeclared (expert-parallel received rows, a packed
row length, a CP shard length) is compiled static first and recompiled with the size dynamic at its first change:
Dynamo's reason is ``tensor '...' size mismatch at index N``, which the compile summary counts as
``dynamic_recompiles``. Each recipe runs with its own parallel layout (EP, CP, AC mode, nested FSDP units), on 2
ranks (the MedPix recipe's EP2 x CP2 with ep over the cp ranks), with backend ``aot_eager``: Dynamo's
frames and guards and AOTAutograd's joint graphs are those of inductor, without inductor's minutes of codegen.
The synthetic recipe runs with rows whose length varies per step (``data.fixed_length=false``); the other recipes'
data kinds (text, medpix) pack every row to a fixed length.
"""

from __future__ import annotations

import pytest

from tests.launch import run_recipe

pytestmark = [pytest.mark.functional, pytest.mark.slow]

STEPS = 4
COMPILED = [f"train.steps={STEPS}", "train.warmup_steps=1", "compile.enabled=true", "compile.backend=aot_eager"]
COUNTS = ("compiles_fwd", "compiles_bwd", "layout_compiles", "bwd_graphs", "graph_breaks")
# recipe -> (ranks, overrides)
RECIPES = {
    # EP2 x CP2 (ulysses) on 2 ranks (ep over the cp ranks), two block layouts (Gated DeltaNet, attention)
    "tiny/qwen3_6_medpix_tiny.yaml": (2, []),
    "tiny/nemotron_super_v3_tiny.yaml": (2, []),  # EP2, three block layouts (Mamba-2, MoE, attention)
    # CP2 (ulysses), full AC, a dense and a MoE layout (offload is not allowed with compile)
    "tiny/glm_4_5_air_tiny.yaml": (2, ["activation_checkpointing.offload=false"]),
    # packed documents of varying lengths (the per-batch ints) in rows of varying length (80, 48, 80, 72 tokens in
    # the 4 steps): the plan marks the blocks' token dims dynamic from the first compile
    "tiny/qwen3_moe_tiny.yaml": (2, ["data.fixed_length=false"]),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_first_steps_compile_each_block_layout_once(recipe, tmp_path):
    nproc, overrides = RECIPES[recipe]
    run = run_recipe(recipe, nproc=nproc, run_dir=tmp_path, overrides=[*COMPILED, *overrides]).check()
    assert len(run.metrics) == STEPS
    summary = run.summary
    reasons = {k: v for k, v in summary.items() if k.startswith("recompile_reasons")}
    assert summary["dynamic_recompiles"] == 0, reasons
    assert summary["recompiles_fwd"] == summary["recompiles_bwd"] == 0, reasons
    assert summary["eager_fallbacks"] == 0, summary
    assert "FAILURE" not in run.output
    first = run.metrics[0]
    assert first["compiles_fwd"] >= 1, first
    for record in run.metrics[1:]:  # every graph compiled in step 1; later steps reuse them
        assert {k: record[k] for k in COUNTS} == {k: first[k] for k in COUNTS}, (record["step"], record, first)
