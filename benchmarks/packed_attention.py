"""One attention core over packed rows, forward + backward, per CP rank: the dense SDPA reference vs the tiled op.

For per-rank lengths 2k .. 32k, rows of documents with mean length 512 and rows of one document, in the three
places attention runs (what rank 0 computes; collectives are not timed, this is one process):

- local: the whole row on one rank;
- ulysses cp2: after the sequence->heads all-to-all a rank attends over the full row (2x the per-rank length) with
  half the heads;
- ring cp2: a rank's two head-tail chunks attend over its own and then the other rank's K/V block (two steps,
  merged with the log-sum-exp).

Per cell: peak memory of the step (tracked allocations on CPU, see ``_measure.peak_bytes``), FLOPs counted with
FlopCounterMode over what the kernels run, the visible-pair FLOPs (14 * head_dim per visible (query, key) pair and
head: 4 forward, 10 backward with the recompute), their ratio, and the median time. The dense path is skipped where
its [S, S] state would not fit (``--dense-gib``); the tiled path where its counted work exceeds ``--budget-gflop``
(one-document rows are quadratic in S by nature: every pair is visible), with the FLOPs then taken from the exact
tile count. Run: ``python benchmarks/packed_attention.py`` (``--quick`` for 2k-8k).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, write_json
from _measure import flop_mapping, peak_bytes, release_free_memory, time_steps

from nemo_ac.distributed.context_parallel.ring import ring_block_update, ring_kernel_step
from nemo_ac.distributed.context_parallel.sharding import (
    document_extents,
    ring_attention_inputs,
    shard_positions,
)
from nemo_ac.models.common import packed_attention as tiled
from nemo_ac.models.common.attention import (
    build_attention_inputs,
    packed_causal_attention,
    tiled_packed_attention,
)

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int


def document_row(length: int, *, mean: int | None, seed: int) -> torch.Tensor:
    """[1, length] document ids: lengths uniform in [mean/4, 7*mean/4] (mean ``mean``), or one document."""
    if mean is None:
        return torch.zeros(1, length, dtype=torch.long)
    rng = random.Random(seed)
    ids, doc = [], 0
    while len(ids) < length:
        ids += [doc] * rng.randint(mean // 4, 7 * mean // 4)
        doc += 1
    return torch.tensor(ids[:length]).unsqueeze(0)


def visible_pairs(docs: torch.Tensor, q_positions: torch.Tensor) -> int:
    """(query, key) pairs with the key in the query's document at or before it, for the given query positions."""
    start, _ = document_extents(docs)
    return int((q_positions - start[0, q_positions] + 1).sum())


def _qkv(length: int, heads: int, kv_heads: int, head_dim: int, *, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, heads, head_dim, generator=g).requires_grad_()
    k = torch.randn(1, length, kv_heads, head_dim, generator=g).requires_grad_()
    v = torch.randn(1, length, kv_heads, head_dim, generator=g).requires_grad_()
    return q, k, v


class Cell:
    """One (mode, per-rank length, documents) configuration: rank 0's inputs and its step for each path."""

    def __init__(self, mode: str, length: int, docs_mean: int | None, shape: Shape) -> None:
        self.mode, self.length = mode, length
        full = 2 * length if mode != "local" else length
        self.docs = document_row(full, mean=docs_mean, seed=length)
        h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
        if mode == "ulysses_cp2":  # a head shard over the full row
            self.q, self.k, self.v = _qkv(full, h // 2, max(hkv // 2, 1), d, seed=1)
            self.heads = h // 2
            self.q_positions = torch.arange(full)
        elif mode == "ring_cp2":
            self.q, self.k, self.v = _qkv(full, h, hkv, d, seed=1)  # full tensors; rank 0 takes its chunks
            self.heads = h
            self.q_positions = shard_positions(full, cp_size=2, cp_rank=0, cp_type="ring")
        else:
            self.q, self.k, self.v = _qkv(full, h, hkv, d, seed=1)
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
            if path == "dense":
                state = ring_block_update(
                    state,
                    q[:, local].transpose(1, 2),
                    k[:, pos].transpose(1, 2),
                    v[:, pos].transpose(1, 2),
                    q_doc=self.docs[:, local],
                    meta=meta,
                    src=src,
                    cp_rank=0,
                    cp_size=2,
                    scale=scale,
                )
            else:
                state = ring_kernel_step(
                    state,
                    q[:, local],
                    k[:, pos],
                    v[:, pos],
                    q_doc=self.docs[:, local],
                    meta=meta,
                    src=src,
                    cp_rank=0,
                    cp_size=2,
                    scale=scale,
                    kernel="tiled",
                )
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

    def tiled_tile_gflop(self) -> float:
        """The tiled kernels' FLOPs from the exact count of computed tile pairs (what FlopCounterMode counts)."""
        total = 0
        tile = tiled.DEFAULT_TILE
        for q, k, _, q_doc, k_doc, q_pos, k_pos, bounds in self._tiled_calls():
            t = tiled._Tiled(q, k, k, q_doc, k_doc, q_pos, k_pos, tile, **bounds)
            total += t.pairs().shape[0] * tile * tile * q.shape[2] * q.shape[3] * 14
        return total / 1e9

    def counted_gflop(self, path: str) -> float:
        counter = FlopCounterMode(display=False, custom_mapping=flop_mapping(visible_fraction=None))
        with counter:
            if path == "dense":
                self.step("dense")
            else:  # the custom op is opaque to FlopCounterMode: count its plain-torch implementation
                for q, k, v, q_doc, k_doc, q_pos, k_pos, bounds in self._tiled_calls():
                    q, k, v = q.detach(), k.detach(), v.detach()  # as inside the op: no autograd graph
                    ids = (q_doc, k_doc, q_pos, k_pos)
                    out, lse = tiled.tiled_attention_forward(q, k, v, *ids, scale=q.shape[-1] ** -0.5, **bounds)
                    tiled.tiled_attention_backward(
                        torch.ones_like(out), q, k, v, *ids, out, lse, scale=q.shape[-1] ** -0.5, **bounds
                    )
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
    tile_gflop = cell.tiled_tile_gflop() if path == "tiled" else None
    if path == "tiled" and tile_gflop > budget_gflop:
        row["skipped"] = f"{tile_gflop:.0f} GFLOP > --budget-gflop"
        row["gflop_from_tiles"] = round(tile_gflop, 3)
        row["flop_ratio"] = round(tile_gflop / row["visible_gflop"], 3)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--quick", action="store_true", help="lengths 2k-8k")
    parser.add_argument("--modes", nargs="+", default=["local", "ulysses_cp2", "ring_cp2"])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tile", type=int, default=tiled.DEFAULT_TILE, help="the tiled op's tile edge")
    parser.add_argument("--budget-gflop", type=float, default=250.0, help="largest tiled cell actually run")
    parser.add_argument("--dense-gib", type=float, default=6.0, help="largest dense [S, S] state actually run")
    parser.add_argument("--out", default=str(RESULTS / "packed_attention.json"))
    args = parser.parse_args()
    lengths = [2048, 4096, 8192] if args.quick else args.lengths
    tiled.DEFAULT_TILE = args.tile
    torch.manual_seed(0)
    started = time.time()
    shape = Shape(args.heads, args.kv_heads, args.head_dim)
    rows = []
    for docs_mean, docs_name in ((512, "mean 512"), (None, "one document")):
        for mode in args.modes:
            for length in lengths:
                cell = Cell(mode, length, docs_mean, shape)
                for path in ("dense", "tiled"):
                    row = {
                        **measure(
                            cell, path, repeats=args.repeats, budget_gflop=args.budget_gflop, dense_gib=args.dense_gib
                        ),
                        "docs": docs_name,
                    }
                    rows.append(row)
                    print(row, flush=True)
    growth(rows)
    headers = ["docs", "mode", "per-rank S", "path", "peak MiB", "x prev S", "GFLOP", "visible GFLOP", "ratio", "ms"]
    table_rows = [
        [
            r["docs"],
            r["mode"],
            r["length"],
            r["path"],
            r.get("peak_mib", r.get("skipped")),
            r.get("peak_growth"),
            r.get("gflop", r.get("gflop_from_tiles")),
            r["visible_gflop"],
            r.get("flop_ratio"),
            r.get("median_ms"),
        ]
        for r in rows
    ]
    table = markdown_table(headers=headers, rows=table_rows)
    print(table)
    shape_line = (
        f"heads {args.heads}, kv heads {args.kv_heads}, head_dim {args.head_dim}, fp32, batch 1, tile {args.tile}"
    )
    write_json(Path(args.out), payload={"shape": shape_line, "rows": rows}, table=table, wall_s=time.time() - started)
    Path(args.out).with_suffix(".md").write_text(f"# Packed attention, {shape_line}\n\n{table}\n")


if __name__ == "__main__":
    main()
