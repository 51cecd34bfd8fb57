"""The memory levers before and after, by ``nemo-ac plan`` on h100-80gb: docs/planning.md's "Memory levers" table.

    python benchmarks/plan_levers.py [--out benchmarks/results/plan_levers]

Each row is one dry run (``nemo-ac plan RECIPE --world-size N --gpu h100-80gb --json``, full depth) of a flagship
with the overrides that switch levers on or off. Every figure is the dry run's estimate, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
QWEN = "qwen3_6_35b_medpix_ep8cp2_4k.yaml"
GLM = "glm_4_5_air_cp4_ulysses.yaml"
NO_LEVERS = ["train.loss_chunk_tokens=0", "train.optimizer_offload=none"]
# (label, recipe, world size, levers, overrides)
ROWS: list[tuple[str, str, int, str, list[str]]] = [
    ("Qwen3.6 EP8 x CP2, 8", QWEN, 8, "none", NO_LEVERS),
    ("Qwen3.6 EP8 x CP2, 8", QWEN, 8, "chunked loss", ["train.optimizer_offload=none"]),
    ("Qwen3.6 EP8 x CP2, 8", QWEN, 8, "chunked loss + states on host (recipe)", []),
    ("Qwen3.6 EP8 x CP2, 8", QWEN, 8, "chunked loss + bf16 moments on the device", ["train.optimizer_offload=none",
                                                                                 "train.optimizer_state_dtype=bfloat16"]),
    ("Qwen3.6 EP8 x CP2, 8", QWEN, 8, "chunked loss + bf16 masters + bf16 moments on the device", [
        "train.optimizer_offload=none", "train.master_dtype=bfloat16", "train.optimizer_state_dtype=bfloat16"]),
    ("Qwen3.6 EP8 x CP2, 8", QWEN, 8, "chunked loss + fp8 moments on the device", ["train.optimizer_offload=none",
                                                                                "train.optimizer_state_dtype=float8"]),
    ("Qwen3.6 EP8 x CP2, 8", QWEN, 8, "chunked loss + bf16 masters + fp8 moments on the device", [
        "train.optimizer_offload=none", "train.master_dtype=bfloat16", "train.optimizer_state_dtype=float8"]),
    ("GLM-4.5-Air CP4, 16", GLM, 16, "fused AdamW, mb 1", [*NO_LEVERS, "train.micro_batch_size=1"]),
    ("GLM-4.5-Air CP4, 16", GLM, 16, "+ chunked loss + states on host, mb 1", ["train.optimizer_offload=states",
                                                                                "train.micro_batch_size=1"]),
    ("GLM-4.5-Air CP4, 8 (one node)", GLM, 8, "chunked loss + states on host, mb 1", ["train.optimizer_offload=states",
                                                                                      "train.micro_batch_size=1"]),
    ("GLM-4.5-Air CP4, 8 (one node)", GLM, 8, "chunked loss + full offload, mb 1", ["train.optimizer_offload=full",
                                                                                    "train.micro_batch_size=1"]),
    ("GLM-4.5-Air CP4, 16", GLM, 16, "+ chunked loss + bf16 moments on the device, mb 1", [
        "train.optimizer_offload=none", "train.optimizer_state_dtype=bfloat16", "train.micro_batch_size=1"]),
    ("GLM-4.5-Air CP4, 16", GLM, 16, "+ chunked loss + bf16 masters + fp8 moments on the device, mb 1", [
        "train.optimizer_offload=none", "train.master_dtype=bfloat16", "train.optimizer_state_dtype=float8",
        "train.micro_batch_size=1"]),
    ("GLM-4.5-Air CP4, 8 (one node)", GLM, 8, "chunked loss + full offload, mb 8 (recipe)", []),
    ("GLM-4.5-Air CP4, 8 (one node)", GLM, 8, "chunked loss + full offload + bf16 moments, mb 8", [
        "train.optimizer_state_dtype=bfloat16"]),
    ("GLM-4.5-Air CP4, 8 (one node)", GLM, 8, "chunked loss + full offload + bf16 masters + bf16 moments, mb 8", [
        "train.master_dtype=bfloat16", "train.optimizer_state_dtype=bfloat16"]),
    ("GLM-4.5-Air CP4, 8 (one node)", GLM, 8, "chunked loss + full offload + bf16 masters + fp8 moments, mb 8", [
        "train.master_dtype=bfloat16", "train.optimizer_state_dtype=float8"]),
]  # fmt: skip


def plan(recipe: str, world: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        command = [sys.executable, "-m", "nemo_ac.cli", "plan", str(ROOT / "recipes" / recipe), "--world-size",
                   str(world), "--gpu", "h100-80gb", "--json", str(out), *overrides]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"{recipe} {overrides}: {(done.stdout + done.stderr)[-2000:]}")
        return json.loads(out.read_text())


def row(label: str, levers: str, report: dict) -> str:
    memory, estimate = report["memory"], report["estimates"][0]
    headroom = estimate["headroom_bytes"] / GiB
    fits = f"**yes (+{headroom:.2f})**" if estimate["fits"] else f"no ({headroom:+.2f})"
    host = estimate["host_bytes_per_node"] / GiB
    tokens = estimate["tokens_per_s"] / report["world_size"]
    return (
        f"| {label} | {levers} | {memory['peak_bytes'] / GiB:.2f} ({memory['phase_at_peak']}) | {fits} | "
        f"{f'{host:,.1f}' if host else '-'} | {estimate['step_s']:.2f} | "
        f"{estimate['host_step_s'] + estimate['host_link_blocking_s']:.2f} | {tokens:,.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/plan_levers"))
    args = parser.parse_args()
    lines = [
        "| recipe, ranks | levers | peak GiB per rank (at) | fits (headroom GiB) | host GiB per node | "
        "step s (estimate) | of which host s (blocking link + host step) | tokens/s per GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    reports = []
    for label, recipe, world, levers, overrides in ROWS:
        report = plan(recipe, world, overrides)
        reports.append({"label": label, "levers": levers, "overrides": overrides, "plan": report})
        lines.append(row(label, levers, report))
        print(lines[-1], flush=True)
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps(reports, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
