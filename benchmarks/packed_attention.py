"""Packed-document attention, forward + backward: nemo_ac's op against SDPA on the same inputs, in one process.

Default table (``--table sdpa``): per row length S (2k .. 32k), layout and dtype (fp32, bf16), the op as the recipes
call it (``backend.attention: tiled``, ``tiled_packed_attention``: the kernel it picks is named, ``spans`` or
``tiles``) against SDPA's fused CPU kernel: ``is_causal`` for rows of one document, the dense [B, 1, S, S] document
mask (``packed_causal_attention``, the reference) for rows of documents with mean length 512. The two run on the
same q / k / v, interleaved (tiled, SDPA, SDPA, tiled, ...) after one warm-up each, so a busy shared CPU slows both
alike; reported: the medians, each one's min-max spread, the median of the per-repeat ratios with its min-max, and
peak memory of one step (tracked allocations, ``_measure.peak_bytes``). The dense mask is not run where its
[S, S] state (~5 bytes per element: the bool mask and SDPA's float copy of it) exceeds ``--dense-gib``.

``--table modes``: the per-CP-rank table (local, ulysses cp2, ring cp2) of memory growth and counted FLOPs against
the visible pairs, the dense SDPA reference against the op (``packed_attention_modes.{md,json}``):

- local: the whole row on one rank;
- ulysses cp2: after the sequence->heads all-to-all a rank attends over the full row (2x the per-rank length) with
  half the heads;
- ring cp2: a rank's two head-tail chunks attend over its own and then the other rank's K/V block (two steps,
  merged with the log-sum-exp).

Per cell: peak memory of the step, FLOPs counted with FlopCounterMode (the op through its registered formula: the
visible pairs it must compute; the dense path through SDPA's), the visible-pair FLOPs (14 * head_dim per visible
(query, key) pair and head: 4 forward, 10 backward with the recompute), their ratio, and the median time. The dense
path is skipped where its [S, S] state would not fit (``--dense-gib``).

``--table crossover``: the op's two kernels (dense spans, the tiled loop) on rows of documents of mean length
16 .. 256: where ``SPAN_MIN_RUN`` sits (``packed_attention_crossover.{md,json}``).

Run: ``python benchmarks/packed_attention.py`` (``--quick`` for 2k-8k).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, write_json
from _measure import _sdpa_formulas, peak_bytes, release_free_memory, time_steps

from nemo_ac.distributed.context_parallel.ring import ring_block_update, ring_kernel_step
from nemo_ac.distributed.context_parallel.sharding import (
    document_extents,
    ring_attention_inputs,
    shard_positions,
)
from nemo_ac.models.common import packed_attention as packed_attention_module
from nemo_ac.models.common.attention import (
    build_attention_inputs,
    packed_causal_attention,
    tiled_packed_attention,
)
from nemo_ac.models.common.packed_attention import packed_attention

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_sdpa_formulas() -> dict:
    return _sdpa_formulas(visible_fraction=None)


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


# ---------------------------------------------------------------------------------------------------------------
# --table sdpa: the op against SDPA on the same inputs

LAYOUTS = {"one document": None, "mean 512": 512}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sdpa_peer(layout: str):
    """SDPA's fused CPU kernel as a user would call it for the layout: ``is_causal`` for one document (GQA read by
    the kernel), the dense document mask for packed rows (the reference)."""
    if layout == "one document":

        def causal(q, k, v, attn):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
            return out.transpose(1, 2)

        return causal
    return packed_causal_attention


def _interleaved(steps: dict, *, repeats: int) -> dict[str, list[float]]:
    """Seconds per step of each entry, alternating the order every repeat, after one warm-up each."""
    names = list(steps)
    for name in names:
        steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            started = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - started)
    return times


def compare(
    length: int, layout: str, dtype: str, shape: Shape, *, repeats: int, dense_gib: float, budget_gflop: float
) -> dict:
    docs = document_row(length, mean=LAYOUTS[layout], seed=length)
    attn = build_attention_inputs(docs)
    q, k, v = (t.detach().to(DTYPES[dtype]).requires_grad_() for t in _qkv(length, *dataclasses.astuple(shape), seed=1))
    pos = torch.arange(length)
    ids = packed_attention_module.PackedIds(q_doc=docs, k_doc=docs, q_pos=pos, k_pos=pos, max_back=attn.max_seqlen)
    plan = packed_attention_module.span_plan(q, ids, tile=packed_attention_module.DEFAULT_TILE)
    row = {"S": length, "layout": layout, "dtype": dtype, "kernel": "spans" if plan is not None else "tiles"}
    extents = torch.unique_consecutive(docs[0], return_counts=True)[1]
    visible_gflop = float((extents * (extents + 1) // 2).sum()) * shape.heads * shape.head_dim * 14 / 1e9
    row["visible_gflop"] = round(visible_gflop, 1)
    if visible_gflop > budget_gflop:
        row["skipped"] = f"not run: {visible_gflop:.0f} visible GFLOP > --budget-gflop"
        return row

    def step(op):
        def run() -> None:
            op(q, k, v, attn).sum().backward()
            q.grad = k.grad = v.grad = None

        return run

    steps = {"tiled": step(tiled_packed_attention)}
    state_gib = length * length * 5 / 2**30
    if layout == "one document" or state_gib <= dense_gib:
        steps["sdpa"] = step(sdpa_peer(layout))
    else:
        row["sdpa_skipped"] = f"not run: dense mask, {state_gib:.2g} GiB of [S, S] state > --dense-gib"
    for name, run in steps.items():
        release_free_memory()
        row[f"{name}_peak_mib"] = round(peak_bytes(run, device=torch.device("cpu")) / 2**20, 1)
    times = _interleaved(steps, repeats=repeats)
    for name, values in times.items():
        row[f"{name}_ms"] = round(statistics.median(values) * 1e3, 1)
        row[f"{name}_spread_ms"] = [round(min(values) * 1e3, 1), round(max(values) * 1e3, 1)]
    if "sdpa" in times:
        ratios = [t / p for t, p in zip(times["tiled"], times["sdpa"])]
        row["ratio"] = round(statistics.median(ratios), 3)
        row["ratio_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return row


def _spread(row: dict, key: str) -> str | None:
    if key not in row:
        return None
    lo, hi = row[key]
    return f"{lo:g}-{hi:g}"


def sdpa_table(args: argparse.Namespace, shape: Shape, lengths: list[int]) -> tuple[list[dict], str]:
    rows = []
    for layout in args.layouts:
        for dtype in args.dtypes:
            for length in lengths:
                row = compare(
                    length,
                    layout,
                    dtype,
                    shape,
                    repeats=args.repeats,
                    dense_gib=args.dense_gib,
                    budget_gflop=args.budget_gflop,
                )
                rows.append(row)
                print(row, flush=True)
    return rows, sdpa_markdown(rows)


def sdpa_markdown(rows: list[dict]) -> str:
    headers = [
        "S",
        "layout",
        "dtype",
        "kernel",
        "tiled ms",
        "tiled min-max",
        "SDPA ms",
        "SDPA min-max",
        "ratio",
        "ratio min-max",
        "tiled peak MiB",
        "SDPA peak MiB",
    ]
    table_rows = [
        [
            r["S"],
            r["layout"],
            r["dtype"],
            r["kernel"],
            r.get("tiled_ms", r.get("skipped")),
            _spread(r, "tiled_spread_ms"),
            r.get("sdpa_ms", r.get("sdpa_skipped")),
            _spread(r, "sdpa_spread_ms"),
            None if "ratio" not in r else f"{r['ratio']:.3f}",
            _spread(r, "ratio_spread"),
            r.get("tiled_peak_mib"),
            r.get("sdpa_peak_mib"),
        ]
        for r in rows
    ]
    return markdown_table(headers=headers, rows=table_rows)


def merged_table(args: argparse.Namespace, shape: Shape, lengths: list[int]) -> tuple[list[dict], str]:
    """The rows of earlier ``--table sdpa`` runs (``--merge A.json B.json``: e.g. one run per layout, each with its
    own limits), in layout / dtype / S order."""
    rows = [row for path in args.merge for row in json.loads(Path(path).read_text())["rows"]]
    order = {name: i for i, name in enumerate(LAYOUTS)}
    rows.sort(key=lambda r: (order[r["layout"]], list(DTYPES).index(r["dtype"]), r["S"]))
    return rows, sdpa_markdown(rows)


def modes_table(args: argparse.Namespace, shape: Shape, lengths: list[int]) -> tuple[list[dict], str]:
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
            r.get("gflop"),
            r["visible_gflop"],
            r.get("flop_ratio"),
            r.get("median_ms"),
        ]
        for r in rows
    ]
    return rows, markdown_table(headers=headers, rows=table_rows)


def crossover_table(args: argparse.Namespace, shape: Shape, lengths: list[int]) -> tuple[list[dict], str]:
    """The op's two kernels on the same rows of documents of mean length 16 .. 256 (fp32, forward + backward): where
    dense spans overtake the tiled loop (``SPAN_MIN_RUN``)."""
    rows = []
    for length in lengths:
        for mean in (16, 32, 64, 128, 256):
            docs = document_row(length, mean=mean, seed=length)
            attn = build_attention_inputs(docs)
            q, k, v = _qkv(length, *dataclasses.astuple(shape), seed=1)
            kw = {"q_doc": docs, "k_doc": docs, "q_pos": torch.arange(length), "k_pos": torch.arange(length)}

            def run(tile: int, q=q, k=k, v=v, kw=kw, attn=attn) -> None:
                out, _ = packed_attention(q, k, v, tile=tile, max_back=attn.max_seqlen, **kw)
                out.sum().backward()
                q.grad = k.grad = v.grad = None

            tile = packed_attention_module.choose_tile(attn.max_seqlen)
            times = _interleaved(
                {"spans": lambda: run(packed_attention_module.DENSE_SPANS), "tiles": lambda t=tile: run(t)},
                repeats=args.repeats,
            )
            row = {"S": length, "mean": mean, "tile": tile}
            row.update({f"{name}_ms": round(statistics.median(v) * 1e3, 1) for name, v in times.items()})
            row["spans / tiles"] = round(row["spans_ms"] / row["tiles_ms"], 3)
            rows.append(row)
            print(row, flush=True)
    headers = ["S", "mean document", "tile", "spans ms", "tiles ms", "spans / tiles"]
    table_rows = [[r["S"], r["mean"], r["tile"], r["spans_ms"], r["tiles_ms"], r["spans / tiles"]] for r in rows]
    return rows, markdown_table(headers=headers, rows=table_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=["sdpa", "modes", "crossover"], default="sdpa")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--quick", action="store_true", help="lengths 2k-8k")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", default=["local", "ulysses_cp2", "ring_cp2"])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tile", type=int, default=packed_attention_module.DEFAULT_TILE, help="the op's tile: 0 auto, >0 the loop"
    )
    parser.add_argument("--budget-gflop", type=float, default=250.0, help="largest cell run (visible GFLOP)")
    parser.add_argument("--dense-gib", type=float, default=2.0, help="largest dense [S, S] state actually run")
    parser.add_argument("--merge", nargs="+", default=None, help="JSONs of --table sdpa runs to write as one table")
    parser.add_argument("--out", default=None, help="JSON path (default: results/packed_attention[_modes].json)")
    args = parser.parse_args()
    lengths = [2048, 4096, 8192] if args.quick else args.lengths
    packed_attention_module.DEFAULT_TILE = args.tile
    torch.manual_seed(0)
    started = time.time()
    shape = Shape(args.heads, args.kv_heads, args.head_dim)
    build = {"sdpa": sdpa_table, "modes": modes_table, "crossover": crossover_table}[args.table]
    if args.merge:
        build = merged_table
    rows, table = build(args, shape, lengths)
    print(table)
    name = "packed_attention" if args.table == "sdpa" else f"packed_attention_{args.table}"
    out = Path(args.out or RESULTS / f"{name}.json")
    shape_line = (
        f"heads {args.heads}, kv heads {args.kv_heads}, head_dim {args.head_dim}, batch 1, tile {args.tile} "
        f"(0: chosen per call), {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    write_json(out, payload={"shape": shape_line, "rows": rows}, table=table, wall_s=time.time() - started)
    title = {"sdpa": "vs SDPA", "modes": "per CP rank", "crossover": "kernels: spans vs tiles"}[args.table]
    runs = [json.loads(Path(path).read_text()).get("command", path) for path in args.merge or ()]
    sources = "".join(f"- `{command}`\n" for command in runs)
    sources = f"Rows of these runs (interleaved medians, min-max over repeats):\n\n{sources}\n" if runs else ""
    out.with_suffix(".md").write_text(f"# Packed attention {title}, {shape_line}\n\n{sources}{table}\n")


if __name__ == "__main__":
    main()
