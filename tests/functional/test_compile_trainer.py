"""torch.compile (inductor) through the trainer: both layouts in one 2-rank launch, packed variable-length data,
backward on a worker thread (the GPU autograd thread's situation); no compile after step 2 on any thread, the
losses of the eager run, and each graph compiled by one rank and loaded by the other (``compile.node_shared_cache``,
on a fresh inductor cache).

One compiled launch covers both layouts: with ``model.first_k_dense_replace=1`` ``compile.layout: auto`` compiles the
dense block 0 as compile(AC(block)) and the MoE block 1, whose experts are a nested FSDP unit, as AC(compile(block)).
``compile.dynamic: true`` makes sequence lengths symbolic from the first compile, so every frame compiles once
(cold inductor compiles dominate this test's time); the declared per-batch ints are dynamic either way.
"""

from __future__ import annotations

import pytest

from tests.launch import assert_close_rel, run_recipe

pytestmark = [pytest.mark.functional, pytest.mark.slow]  # cold inductor compiles on 2 ranks

RECIPE = "tiny/qwen3_moe_tiny.yaml"
COMMON = [
    "train.steps=6",
    "model.num_layers=2",
    "model.first_k_dense_replace=1",
    "data.fixed_length=false",
    "train.backward_on_thread=true",
]
COUNTS = ("compiles_fwd", "compiles_bwd", "recompiles_fwd", "recompiles_bwd", "bwd_graphs", "graph_breaks")


def test_compiled_layouts_never_compile_after_step_2_on_any_thread_and_match_eager(tmp_path):
    eager = run_recipe(RECIPE, nproc=2, run_dir=tmp_path / "eager", overrides=COMMON).check()
    compiled = run_recipe(
        RECIPE,
        nproc=2,
        run_dir=tmp_path / "compiled",
        overrides=[*COMMON, "compile.enabled=true", "compile.backend=inductor", "compile.dynamic=true"],
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},  # cold: every graph is compiled on this node
    ).check()

    assert "compile | inductor | layouts: compile_outer, ac_outer" in compiled.output
    assert len(compiled.metrics) == 6
    lengths = {m["tokens"] for m in compiled.metrics}
    assert len(lengths) > 2, f"packed lengths should vary per step: {lengths}"

    step2 = compiled.metrics[1]
    assert step2["compiles_fwd"] >= 2, step2  # both blocks really compiled
    assert step2["graph_breaks"] >= 1, step2  # the ac_outer block breaks at its experts unit's FSDP hooks
    for record in compiled.metrics[2:]:
        assert {k: record[k] for k in COUNTS} == {k: step2[k] for k in COUNTS}, (record["step"], record, step2)
    for record in compiled.metrics:
        assert record["eager_fallbacks"] == 0, record
        assert record["recompiles_fwd"] == record["recompiles_bwd"] == 0, record  # dynamic from the first compile

    assert compiled.summary["compiles_fwd"] == step2["compiles_fwd"]
    assert "compile | fwd thread:" in compiled.output

    # compile.node_shared_cache: each graph is compiled by one rank (an FX graph cache miss) and loaded by the other
    # (a hit). Without the node lock both ranks compile every graph: misses [11, 11], hits [0, 0].
    misses, hits = compiled.summary["fxgraph_misses_per_rank"], compiled.summary["fxgraph_hits_per_rank"]
    graphs = misses[0] + hits[0]
    assert graphs >= 4 and misses[1] + hits[1] == graphs, (misses, hits)  # forward and backward of both blocks
    assert sum(misses) == graphs and sum(hits) == graphs, f"a graph compiled on both ranks: {misses=} {hits=}"
    assert (
        "one compile per graph per node" in compiled.output
        and "inductor FX graph cache over 2 ranks" in compiled.output
    )
    assert_close_rel(compiled.losses, eager.losses, rel=2e-5)
    assert_close_rel([m["grad_norm"] for m in compiled.metrics], [m["grad_norm"] for m in eager.metrics], rel=2e-4)
