"""The per-rank inductor cache line: ranks with equal counts grouped, misses read as compiled, hits as loaded."""

from __future__ import annotations

from nemo_ac.diagnostics.compile_caches import per_rank_report, per_rank_summary


def test_ranks_that_loaded_are_grouped_apart_from_the_rank_that_compiled():
    compiled = {"fxgraph_misses": 6, "fxgraph_hits": 0}
    loaded = {"fxgraph_misses": 0, "fxgraph_hits": 6}
    line = per_rank_report([compiled, loaded, loaded, loaded])
    assert line == (
        "compile | inductor FX graph cache over 4 ranks: 6 compiled, 18 loaded | rank 0 compiled 6, loaded 0 | "
        "ranks 1-3 compiled 0, loaded 6"
    ), line
    summary = per_rank_summary([compiled, loaded])
    assert summary["fxgraph_misses_per_rank"] == [6, 0] and summary["fxgraph_hits_per_rank"] == [0, 6]
    assert summary["aot_cache_hits_per_rank"] == [0, 0]
