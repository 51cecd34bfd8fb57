"""The flagship layer table's rendering: the markdown report (caps, the one-line summary per row, every
measurement, profiles, implementations) and the achieved / peak chart. ``flagship_layers.py`` measures."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from _common import cell, markdown_table

HEADERS = [
    "flagship",
    "sub-block",
    "stack",
    "dtype",
    "median ms (min-max)",
    "peak MiB",
    "model GFLOP",
    "executed GFLOP",
    "GFLOP/s",
    "achieved/peak",
    "time / transformers",
    "memory / transformers",
    "held MiB",
    "held / HF no-AC",
]


def table(records: list[dict[str, Any]]) -> str:
    rows = [
        [
            r["flagship"],
            r["sub_block"],
            r["stack"],
            r["dtype"],
            f"{r['median_ms']:.0f} ({r['min_ms']:.0f}-{r['max_ms']:.0f})",
            r["peak_mib"],
            r["model_gflop"],
            r["executed_gflop"],
            r["achieved_gflops"],
            f"{r['achieved_over_peak']:.2f}",
            f"{r['time_vs_transformers']:.2f}",
            cell(r["memory_vs_transformers"], digits=2),
            cell(r.get("held_mib"), digits=1),
            cell(r.get("held_vs_transformers_no_ac"), digits=2),
        ]
        for r in records
    ]
    return markdown_table(headers=HEADERS, rows=rows)


def summary_table(records: list[dict[str, Any]]) -> str:
    """One line per sub-block and dtype: every stack's median time, and nemo_ac (no-AC) against transformers."""
    lines = []
    keys = list(dict.fromkeys((r["flagship"], r["sub_block"], r["dtype"]) for r in records))
    for key in keys:
        by_stack = {r["stack"]: r for r in records if (r["flagship"], r["sub_block"], r["dtype"]) == key}

        def ms(stack: str, by_stack: dict[str, dict[str, Any]] = by_stack) -> str:
            r = by_stack.get(stack)
            return "—" if r is None else f"{r['median_ms']:.0f}"

        nemo, hf, recipe = by_stack["nemo_ac no-AC"], by_stack["transformers"], by_stack["nemo_ac"]
        am = by_stack.get("automodel")
        lines.append(
            [
                key[0].split("_")[0],
                key[1],
                key[2],
                ms("nemo_ac"),
                ms("nemo_ac no-AC"),
                ms("nemo_ac compiled no-AC"),
                ms("nemo_ac loop no-AC"),
                ms("transformers"),
                ms("automodel"),
                f"{nemo['time_vs_transformers']:.2f}",
                cell(nemo["memory_vs_transformers"], digits=2),
                cell(recipe.get("held_vs_transformers_no_ac"), digits=2),
                nemo["impl"].split("attention=")[-1] if "attention=" in nemo["impl"] else "—",
                f"{nemo['achieved_over_peak']:.2f} / {hf['achieved_over_peak']:.2f}"
                + (f" / {am['achieved_over_peak']:.2f}" if am else ""),
                nemo["model_gflop"],
            ]
        )
    return markdown_table(
        headers=[
            "flagship",
            "sub-block",
            "dtype",
            "nemo_ac (recipe AC) ms",
            "nemo_ac ms",
            "compiled ms",
            "loop ms",
            "transformers ms",
            "automodel ms",
            "time nemo_ac / HF",
            "memory nemo_ac / HF",
            "recipe-AC held / HF no-AC held",
            "nemo_ac attention",
            "achieved/peak nemo_ac / HF / AM",
            "model GFLOP",
        ],
        rows=lines,
    )


def caps_table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        headers=["flagship", "sub-block", "recipe AC", "tokens", "caps"],
        rows=[[r["flagship"], r["label"], r["ac_mode"], r["tokens"], r["caps"]] for r in rows],
    )


def render(rows: list[dict[str, Any]], records: list[dict[str, Any]], *, automodel: str) -> str:
    """The markdown report: caps, the one-line-per-row summary, every measurement, profiles, implementations."""
    notes = [
        f"{r['flagship']} {r['sub_block']} {r['dtype']}: {r['dominant_ops']}" for r in records if r["dominant_ops"]
    ]
    return "\n\n".join(
        [
            caps_table(rows),
            summary_table(records),
            table(records),
            "Where nemo_ac (no-AC) is slower than transformers, its step's top ops by self time:\n"
            + ("\n".join(f"- {n}" for n in notes) or "- none"),
            f"NeMo Automodel: {automodel}",
            "Implementations: " + "; ".join(sorted({f"{r['stack']}: {r['impl']}" for r in records})),
        ]
    )


STACK_COLORS = {"nemo_ac no-AC": (20, 160, 60), "transformers": (230, 120, 0), "automodel": (40, 110, 220)}
CHART_W, PANEL_H, MARGIN = 1000, 250, 40


def chart(records: list[dict[str, Any]], path: Path) -> None:
    """Achieved / peak per row, nemo_ac (no-AC) beside transformers (and Automodel), one panel per dtype. Drawn
    with Pillow (the venv's image library), so the chart needs no plotting package."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        print("Pillow is not installed (pip install pillow): no chart", file=sys.stderr)
        return
    dtypes = sorted({r["dtype"] for r in records})
    stacks = [s for s in STACK_COLORS if any(r["stack"] == s for r in records)]
    image = Image.new("RGB", (CHART_W, len(dtypes) * PANEL_H + 50), "white")
    draw = ImageDraw.Draw(image)
    for index, dtype in enumerate(dtypes):
        keep = [r for r in records if r["dtype"] == dtype and r["stack"] in stacks]
        _bar_panel(draw, keep, stacks, title=dtype, y0=index * PANEL_H)
    y = len(dtypes) * PANEL_H + 8
    for n, stack in enumerate(stacks):
        draw.rectangle((10 + n * 170, y, 20 + n * 170, y + 10), fill=STACK_COLORS[stack])
        draw.text((26 + n * 170, y - 1), stack, fill="black")
    draw.text((10, y + 22), "y: model FLOP/s over this machine's F.linear at the row's dominant GEMM", fill="black")
    image.save(path)
    print(f"wrote {path}", file=sys.stderr)


def _label(record: dict[str, Any]) -> str:
    return f"{record['flagship'].split('_')[0]} {record['sub_block']}"


def _bar_panel(draw: Any, records: list[dict[str, Any]], stacks: list[str], *, title: str, y0: int) -> None:
    labels = sorted({_label(r) for r in records})
    values = {(_label(r), r["stack"]): r["achieved_over_peak"] or 0.0 for r in records}
    top_value = max([1.0, *values.values()])
    left, top, right, bottom = MARGIN, y0 + 22, CHART_W - 10, y0 + PANEL_H - 48
    draw.text((left, y0 + 4), f"{title}: achieved / matmul peak", fill="black")
    draw.rectangle((left, top, right, bottom), outline=(180, 180, 180))
    for tick in (0.25, 0.5, 0.75, 1.0):
        y = bottom - (bottom - top) * tick / top_value
        draw.line((left, y, right, y), fill=(230, 230, 230))
        draw.text((4, y - 6), f"{tick:.2f}", fill=(90, 90, 90))
    slot = (right - left) / max(len(labels), 1)
    bar = slot * 0.8 / max(len(stacks), 1)
    for i, label in enumerate(labels):
        x = left + i * slot + slot * 0.1
        for n, stack in enumerate(stacks):
            value = values.get((label, stack))
            if value:
                y = bottom - (bottom - top) * value / top_value
                draw.rectangle((x + n * bar, y, x + (n + 1) * bar - 2, bottom), fill=STACK_COLORS[stack])
        draw.text((x, bottom + 4 + 12 * (i % 2)), label[:24], fill="black")
