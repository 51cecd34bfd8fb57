"""``packed_attention.py --table modes``: rank 0 of a local, Ulysses cp2 or ring cp2 step (the op against the dense
SDPA reference), its counted FLOPs, peak memory and time (see the script's docstring for the table)."""

from __future__ import annotations

import statistics

import torch
from _common import markdown_table
from _measure import _sdpa_formulas, peak_bytes, release_free_memory, time_steps
from _packed_attention_sdpa import Shape, document_row, qkv
from torch.utils.flop_counter import FlopCounterMode

from nemo_ac.distributed.context_parallel.ring import ring_block_update, ring_kernel_step
from nemo_ac.distributed.context_parallel.sharding import (
    document_extents,
    ring_attention_inputs,
    shard_positions,
)
from nemo_ac.models.layers.attention import (
    build_attention_inputs,
    packed_causal_attention,
    tiled_packed_attention,
)


def cpu_sdpa_formulas() -> dict:
    return _sdpa_formulas(visible_fraction=None)


def visible_pairs(docs: torch.Tensor, q_positions: torch.Tensor) -> int:
    """(query, key) pairs with the key in the query's document at or before it, for the given query positions."""
    start, _ = document_extents(docs)
    return int((q_positions - start[0, q_positions] + 1).sum())


class Cell:
    """One (mode, per-rank length, documents) configuration: rank 0's inputs and its step for each path."""

    def __init__(self, mode: str, length: int, docs_mean: int | None, shape: Shape) -> None:
        self.mode, self.length = mode, length
        full = 2 * length if mode != "local" else length
        self.docs = document_row(full, mean=docs_mean, seed=length)
        h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
        if mode == "ulysses_cp2":  # a head shard over the full row
            self.q, self.k, self.v = qkv(full, h // 2, max(hkv // 2, 1), d, seed=1)
            self.heads = h // 2
            self.q_positions = torch.arange(full)
        elif mode == "ring_cp2":
            self.q, self.k, self.v = qkv(full, h, hkv, d, seed=1)  # full tensors; rank 0 takes its chunks
            self.heads = h
            self.q_positions = shard_positions(full, cp_size=2, cp_rank=0, cp_type="ring")
        else:
            self.q, self.k, self.v = qkv(full, h, hkv, d, seed=1)
            self.heads = h
            self.q_positions = torch.arange(full)
        self.head_dim = d
        self.attn = build_attention_inputs(self.docs)

    def visible_gflop(self) -> float:
        return visible_pairs(self.docs, self.q_positions) * self.heads * self.head_dim * 14 / 1e9

    # -- steps (forward + backward) --------------------------------------------------------------------------

    def _ring_inputs(self):
        meta = ring_attention_inputs(self.docs, cp_size=2, cp_rank=0)
        local = shard_positions(self.docs.shape[1], cp_size=2, cp_rank=0, cp_type="ring")
        blocks = [shard_positions(self.docs.shape[1], cp_size=2, cp_rank=src, cp_type="ring") for src in (0, 1)]
        return meta, local, blocks

    def step(self, path: str) -> None:
        q, k, v = self.q, self.k, self.v
        if self.mode != "ring_cp2":
            op = packed_causal_attention if path == "dense" else tiled_packed_attention
            op(q, k, v, self.attn).sum().backward()
            return
        meta, local, blocks = self._ring_inputs()
        scale = self.head_dim**-0.5
        state = None
        for src, pos in zip((0, 1), blocks):
            step = {"q_doc": self.docs[:, local], "meta": meta, "src": src, "cp_rank": 0, "cp_size": 2, "scale": scale}
            if path == "dense":  # the SDPA ring block: heads-first tensors
                heads_first = (x.transpose(1, 2) for x in (q[:, local], k[:, pos], v[:, pos]))
                state = ring_block_update(state, *heads_first, **step)
            else:
                state = ring_kernel_step(state, q[:, local], k[:, pos], v[:, pos], **step, kernel="tiled")
        out = torch.cat((state[0], state[2]), dim=2) if path == "dense" else state[0]
        out.sum().backward()

    # -- counted FLOPs ----------------------------------------------------------------------------------------

    def _tiled_calls(self):
        """(q, k, v, q_doc, k_doc, q_pos, k_pos, bounds) of every tiled kernel call rank 0 makes."""
        if self.mode != "ring_cp2":
            pos = torch.arange(self.docs.shape[1])
            bounds = {"max_back": max(self.attn.max_seqlen, 1)}
            return [(self.q, self.k, self.v, self.docs, self.docs, pos, pos, bounds)]
        meta, local, blocks = self._ring_inputs()
        bounds = {"min_k_pos": meta.local_k_slice, "max_back": min(meta.max_seqlen_q, meta.max_seqlen_k)}
        return [
            (self.q[:, local], self.k[:, p], self.v[:, p], self.docs[:, local], self.docs[:, p], local, p, bounds)
            for p in blocks
        ]

    def counted_gflop(self, path: str) -> float:
        """FlopCounterMode over one step: the op through its registered formula (the visible pairs), SDPA's dense
        path through torch's formulas for what it executes."""
        # SDPA's CPU kernel has no formula in torch 2.13 (_measure's: what it executes); the op counts by its own.
        counter = FlopCounterMode(display=False, custom_mapping=cpu_sdpa_formulas() if path == "dense" else None)
        with counter:
            self.step(path)
        self.zero_grad()
        return counter.get_total_flops() / 1e9

    def dense_gib(self) -> float:
        """The dense path's [S, S] state: fp32 scores (and their gradient) per head + the bool mask."""
        s_q, s_k = len(self.q_positions), self.docs.shape[1] if self.mode != "ring_cp2" else len(self.q_positions)
        return (self.heads * s_q * s_k * 4 * 3 + s_q * s_k) / 2**30

    def zero_grad(self) -> None:
        for t in (self.q, self.k, self.v):
            t.grad = None


def measure(cell: Cell, path: str, *, repeats: int, budget_gflop: float, dense_gib: float) -> dict:
    row = {"mode": cell.mode, "length": cell.length, "path": path, "visible_gflop": round(cell.visible_gflop(), 3)}
    if path == "dense" and cell.dense_gib() > dense_gib:
        row["skipped"] = f"needs ~{cell.dense_gib():.0f} GiB of [S, S] state"
        return row
    if path == "tiled" and row["visible_gflop"] > budget_gflop:
        row["skipped"] = f"{row['visible_gflop']:.0f} GFLOP > --budget-gflop"
        return row
    release_free_memory()
    row["gflop"] = round(cell.counted_gflop(path), 3)
    row["flop_ratio"] = round(row["gflop"] / row["visible_gflop"], 3)
    release_free_memory()
    row["peak_mib"] = round(peak_bytes(lambda: cell.step(path), device=torch.device("cpu")) / 2**20, 1)
    cell.zero_grad()
    times = time_steps(lambda: cell.step(path), device=torch.device("cpu"), warmup=1, repeats=repeats)
    cell.zero_grad()
    row["median_ms"] = round(statistics.median(times) * 1e3, 1)
    row["spread_ms"] = [round(min(times) * 1e3, 1), round(max(times) * 1e3, 1)]
    return row


def growth(rows: list[dict]) -> None:
    """Peak memory ratio to the previous (half) length of the same mode / documents / path."""
    last: dict[tuple, float] = {}
    for row in rows:
        key = (row["mode"], row["docs"], row["path"])
        if "peak_mib" in row:
            if key in last and last[key] > 0:
                row["peak_growth"] = round(row["peak_mib"] / last[key], 2)
            last[key] = row["peak_mib"]


def modes_markdown(rows: list[dict]) -> str:
    headers = ["docs", "mode", "per-rank S", "path", "peak MiB", "x prev S", "GFLOP", "visible GFLOP", "ratio", "ms"]
    table_rows = [
        [
            r["docs"],
            r["mode"],
            r["length"],
            r["path"],
            r.get("peak_mib", r.get("skipped")),
            r.get("peak_growth"),
            r.get("gflop"),
            r["visible_gflop"],
            r.get("flop_ratio"),
            r.get("median_ms"),
        ]
        for r in rows
    ]
    return markdown_table(headers=headers, rows=table_rows)
