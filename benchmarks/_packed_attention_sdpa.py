"""``packed_attention.py --table sdpa``: the inputs (document rows, q / k / v), SDPA as a user would call it for
each layout, and one interleaved comparison of the op against it (see the script's docstring for what is
reported)."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time

import torch
import torch.nn.functional as F
from _common import markdown_table
from _measure import peak_bytes, release_free_memory

from nemo_ac.models.kernels import packed_attention as packed_attention_module
from nemo_ac.models.layers.attention import (
    build_attention_inputs,
    packed_causal_attention,
    tiled_packed_attention,
)


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


def qkv(length: int, heads: int, kv_heads: int, head_dim: int, *, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, heads, head_dim, generator=g).requires_grad_()
    k = torch.randn(1, length, kv_heads, head_dim, generator=g).requires_grad_()
    v = torch.randn(1, length, kv_heads, head_dim, generator=g).requires_grad_()
    return q, k, v


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


def interleaved(steps: dict, *, repeats: int) -> dict[str, list[float]]:
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
    q, k, v = (t.detach().to(DTYPES[dtype]).requires_grad_() for t in qkv(length, *dataclasses.astuple(shape), seed=1))
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
    times = interleaved(steps, repeats=repeats)
    for name, values in times.items():
        row[f"{name}_ms"] = round(statistics.median(values) * 1e3, 1)
        row[f"{name}_spread_ms"] = [round(min(values) * 1e3, 1), round(max(values) * 1e3, 1)]
    if "sdpa" in times:
        ratios = [t / p for t, p in zip(times["tiled"], times["sdpa"])]
        row["ratio"] = round(statistics.median(ratios), 3)
        row["ratio_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return row


def spread(row: dict, key: str) -> str | None:
    if key not in row:
        return None
    lo, hi = row[key]
    return f"{lo:g}-{hi:g}"


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
            spread(r, "tiled_spread_ms"),
            r.get("sdpa_ms", r.get("sdpa_skipped")),
            spread(r, "sdpa_spread_ms"),
            None if "ratio" not in r else f"{r['ratio']:.3f}",
            spread(r, "ratio_spread"),
            r.get("tiled_peak_mib"),
            r.get("sdpa_peak_mib"),
        ]
        for r in rows
    ]
    return markdown_table(headers=headers, rows=table_rows)
