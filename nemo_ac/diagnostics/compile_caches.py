"""Per-rank inductor cache hits and misses: which ranks compiled a graph and which loaded it.

With ``compile.node_shared_cache`` (``nemo_ac.workarounds.node_shared_compile``) the first rank of a node to reach a
graph compiles it (an FX graph cache *miss*) and the node's other ranks load it (a *hit*); a warm run hits on every
rank. The counts are this process's growth of inductor's ``fxgraph_cache_hit`` / ``fxgraph_cache_miss`` counters (and
AOTAutograd's cache counters) since ``CompileCacheCounts`` was made, read through the workarounds boundary. Each
rank counts its own; ``train.py`` gathers them for the run's summary and its last lines.

This module imports nothing from nemo_ac.distributed / trainer (diagnostics are used by them, not the reverse).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_ac.workarounds.node_shared_compile import CACHE_COUNTERS, compile_cache_counts


class CompileCacheCounts:
    """Inductor / AOTAutograd cache hits and misses of this process from now on."""

    def __init__(self) -> None:
        self.baseline = compile_cache_counts()

    def counts(self) -> dict[str, int]:
        now = compile_cache_counts()
        return {name: now[name] - self.baseline.get(name, 0) for name in CACHE_COUNTERS}


def per_rank_summary(per_rank: Sequence[dict[str, int]]) -> dict[str, Any]:
    """The summary's keys: one list per counter, indexed by rank (``fxgraph_misses_per_rank``: graphs compiled)."""
    return {f"{name}_per_rank": [counts.get(name, 0) for counts in per_rank] for name in CACHE_COUNTERS}


def per_rank_report(per_rank: Sequence[dict[str, int]]) -> str:
    """One line: the totals, then ranks with equal counts grouped, e.g. ``compile | inductor FX graph cache over 4
    ranks: 12 compiled, 36 loaded | rank 0 compiled 12, loaded 0 | ranks 1-3 compiled 0, loaded 12`` (compiled:
    cache misses; loaded: hits). Which rank compiles a graph is whichever reaches it first, so with the node lock
    the compiles split between ranks, and each graph is compiled once per node."""
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, counts in enumerate(per_rank):
        groups.setdefault((counts.get("fxgraph_misses", 0), counts.get("fxgraph_hits", 0)), []).append(rank)
    misses = sum(counts.get("fxgraph_misses", 0) for counts in per_rank)
    hits = sum(counts.get("fxgraph_hits", 0) for counts in per_rank)
    parts = [f"compile | inductor FX graph cache over {len(per_rank)} ranks: {misses} compiled, {hits} loaded"]
    for (rank_misses, rank_hits), ranks in groups.items():
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
        parts.append(f"{label} compiled {rank_misses}, loaded {rank_hits}")
    return " | ".join(parts)


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, value in enumerate(values):
        start = value if start is None else start
        if i + 1 == len(values) or values[i + 1] != value + 1:
            out.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(out)
