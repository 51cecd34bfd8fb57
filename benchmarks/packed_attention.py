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

Run: ``python benchmarks/packed_attention.py`` (``--quick`` for 2k-8k). The inputs, the SDPA peer and one interleaved
comparison live in ``_packed_attention_sdpa.py``, the per-CP-rank cells in ``_packed_attention_cp.py``; this script
builds the tables and writes the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, write_json
from _packed_attention_cp import Cell, growth, measure, modes_markdown
from _packed_attention_sdpa import DTYPES, LAYOUTS, Shape, compare, document_row, interleaved, qkv, sdpa_markdown

from nemo_ac.models.kernels import packed_attention as packed_attention_module
from nemo_ac.models.kernels.packed_attention import packed_attention
from nemo_ac.models.layers.attention import build_attention_inputs

RESULTS = Path(__file__).resolve().parent / "results"


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
    return rows, modes_markdown(rows)


def crossover_table(args: argparse.Namespace, shape: Shape, lengths: list[int]) -> tuple[list[dict], str]:
    """The op's two kernels on the same rows of documents of mean length 16 .. 256 (fp32, forward + backward): where
    dense spans overtake the tiled loop (``SPAN_MIN_RUN``)."""
    rows = []
    for length in lengths:
        for mean in (16, 32, 64, 128, 256):
            docs = document_row(length, mean=mean, seed=length)
            attn = build_attention_inputs(docs)
            q, k, v = qkv(length, *dataclasses.astuple(shape), seed=1)
            kw = {"q_doc": docs, "k_doc": docs, "q_pos": torch.arange(length), "k_pos": torch.arange(length)}

            def run(tile: int, q=q, k=k, v=v, kw=kw, attn=attn) -> None:
                out, _ = packed_attention(q, k, v, tile=tile, max_back=attn.max_seqlen, **kw)
                out.sum().backward()
                q.grad = k.grad = v.grad = None

            tile = packed_attention_module.choose_tile(attn.max_seqlen)
            times = interleaved(
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
    parser.add_argument("--note", default=None, help="a line under the title, e.g. how loaded the machine was")
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
    payload = {"shape": shape_line, "rows": rows, **({"note": args.note} if args.note else {})}
    write_json(out, payload=payload, table=table, wall_s=time.time() - started)
    title = {"sdpa": "vs SDPA", "modes": "per CP rank", "crossover": "kernels: spans vs tiles"}[args.table]
    runs = [json.loads(Path(path).read_text()).get("command", path) for path in args.merge or ()]
    sources = "".join(f"- `{command}`\n" for command in runs)
    sources = f"Rows of these runs (interleaved medians, min-max over repeats):\n\n{sources}\n" if runs else ""
    note = f"{args.note}\n\n" if args.note else ""
    out.with_suffix(".md").write_text(f"# Packed attention {title}, {shape_line}\n\n{note}{sources}{table}\n")


if __name__ == "__main__":
    main()
