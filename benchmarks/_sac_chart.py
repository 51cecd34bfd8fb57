"""The SAC frontier chart (``sac_frontier.py``): one small panel per sub-block, held MiB (x) against recompute
GFLOP (y), a dot per policy and the Automodel - save-every-matmul line. Drawn with Pillow (the venv's image
library), so the chart needs no plotting package."""

from __future__ import annotations

from typing import Any

COLORS = {
    "none": (120, 120, 120),
    "full": (0, 0, 0),
    "torchtitan": (230, 120, 0),
    "automodel": (40, 110, 220),
    "nemo_ac before": (200, 40, 40),
    "nemo_ac": (20, 160, 60),
    "save every matmul": (150, 60, 190),
}
PANEL_W, PANEL_H, PAD = 300, 210, 34


def frontier_chart(records: list[dict[str, Any]], path: str) -> None:
    from PIL import Image, ImageDraw

    cols = 4
    panel_rows = -(-len(records) // cols)
    image = Image.new("RGB", (cols * PANEL_W, panel_rows * PANEL_H + 80), "white")
    draw = ImageDraw.Draw(image)
    for index, rec in enumerate(records):
        x0, y0 = (index % cols) * PANEL_W, (index // cols) * PANEL_H
        _panel(draw, rec, x0, y0)
    y0 = panel_rows * PANEL_H + 6
    for n, (policy, color) in enumerate((p, c) for p, c in COLORS.items() if p != "none"):
        x = 10 + (n % 6) * 190
        draw.ellipse((x, y0, x + 10, y0 + 10), fill=color)
        draw.text((x + 16, y0 - 1), policy, fill="black")
    draw.text(
        (10, y0 + 30),
        "x: held MiB (activations kept for backward), y: recompute GFLOP (bf16, 512 tokens per row); line: Automodel -"
        " save every matmul; nemo_ac ringed; none (0 GFLOP, the most MiB) left out: see the table",
        fill="black",
    )
    image.save(path)


def _panel(draw: Any, rec: dict[str, Any], x0: int, y0: int) -> None:
    # nemo_ac last and ringed, so a point it shares with another policy stays visible; none (0 recompute, 3-10x
    # the held bytes) is left out of the panel to keep the others apart: the table has it.
    order = [p for p in rec["policies"] if p not in ("none", "nemo_ac")] + ["nemo_ac"]
    points = {p: rec["policies"][p] for p in order if p in rec["policies"]}
    xs = [r["held_bytes"] / 2**20 for r in points.values()]
    ys = [r["recompute_flops"] / 1e9 for r in points.values()]
    xmax, ymax = max(xs) * 1.05 or 1.0, max(ys) * 1.1 or 1.0
    left, top, right, bottom = x0 + PAD, y0 + 20, x0 + PANEL_W - 10, y0 + PANEL_H - PAD

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (right - left) * x / xmax, bottom - (bottom - top) * y / ymax

    draw.rectangle((left, top, right, bottom), outline=(180, 180, 180))
    draw.text((x0 + 6, y0 + 4), f"{rec['flagship'].split('_')[0]} {rec['sub_block']}", fill="black")
    draw.text((left, bottom + 4), f"0 .. {xmax:.0f} MiB", fill=(90, 90, 90))
    draw.text((x0 + 2, top), f"{ymax:.0f}", fill=(90, 90, 90))
    a, s = points.get("automodel"), points.get("save every matmul")
    if a and s and a["held_bytes"] != s["held_bytes"]:
        ax, ay = a["held_bytes"] / 2**20, a["recompute_flops"] / 1e9
        sx, sy = s["held_bytes"] / 2**20, s["recompute_flops"] / 1e9
        slope = (sy - ay) / (sx - ax)
        segment = _clip(ay - slope * ax, slope, xmax=xmax, ymax=ymax)
        if segment:
            draw.line([at(*segment[0]), at(*segment[1])], fill=(170, 170, 220), width=1)
    for policy, r in points.items():
        x, y = at(r["held_bytes"] / 2**20, r["recompute_flops"] / 1e9)
        if policy == "nemo_ac":
            draw.ellipse((x - 7, y - 7, x + 7, y + 7), outline=COLORS[policy], width=2)
        else:
            draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=COLORS.get(policy, (0, 0, 0)))


def _clip(intercept: float, slope: float, *, xmax: float, ymax: float) -> list[tuple[float, float]]:
    """The part of ``y = intercept + slope x`` inside [0, xmax] x [0, ymax] (empty when it misses the panel)."""
    lo, hi = 0.0, xmax
    if slope != 0:
        bounds = sorted(((0.0 - intercept) / slope, (ymax - intercept) / slope))
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    elif not 0 <= intercept <= ymax:
        return []
    if lo >= hi:
        return []
    return [(lo, intercept + slope * lo), (hi, intercept + slope * hi)]
