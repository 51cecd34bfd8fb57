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


def chart(records: list[dict[str, Any]], path: Path) -> None:
    """Achieved / peak per row, nemo_ac (no-AC) beside transformers (and Automodel), one panel per dtype."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no chart", file=sys.stderr)
        return
    dtypes = sorted({r["dtype"] for r in records})
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(11, 3.2 * len(dtypes)), squeeze=False)
    for ax, dtype in zip(axes[:, 0], dtypes, strict=True):
        stacks = [s for s in ("nemo_ac no-AC", "transformers", "automodel") if any(r["stack"] == s for r in records)]
        keep = [r for r in records if r["dtype"] == dtype and r["stack"] in stacks]
        labels = sorted({f"{r['flagship'].split('_')[0]} {r['sub_block']}" for r in keep}, key=str)
        width = 0.8 / len(stacks)
        for n, stack in enumerate(stacks):
            offset = (n - (len(stacks) - 1) / 2) * width
            values = {
                f"{r['flagship'].split('_')[0]} {r['sub_block']}": r["achieved_over_peak"]
                for r in keep
                if r["stack"] == stack
            }
            ax.bar(
                [i + offset for i in range(len(labels))], [values.get(label, 0) for label in labels], width, label=stack
            )
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("achieved / matmul peak")
        ax.set_title(f"{dtype}: model FLOP/s over this machine's F.linear at the row's dominant GEMM")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"wrote {path}", file=sys.stderr)
