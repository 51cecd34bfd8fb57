"""The three flagships at their recipes' world sizes, full depth: ``nemo-ac plan`` for H100-80GB and H200-141GB.

    python benchmarks/plan_flagships.py [--depth full|scaled] [--out benchmarks/results/plan_flagships]

Runs each plan as its own process (``nemo-ac plan ... --json``), reads its wall time and peak RSS from the OS
(``os.wait4``), and writes docs/planning.md's table (markdown) and the plans (JSON). Every memory, time and MFU figure in it
is the dry run's estimate, not a measurement; the wall time and RSS are measurements of the dry run itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGSHIPS = [
    ("qwen3_6_35b_medpix_ep8cp2_4k.yaml", 8),
    ("nemotron_super_v3_te_deepep.yaml", 64),
    ("glm_4_5_air_cp4_ulysses.yaml", 8),
]
GiB = 2**30


def run_plan(recipe: Path, world: int, depth: str, out: Path) -> tuple[float, int, str]:
    command = [sys.executable, "-m", "nemo_ac.cli", "plan", str(recipe), "--world-size", str(world), "--gpu",
               "h100-80gb,h200-141gb", "--depth", depth, "--json", str(out)]  # fmt: skip
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        log.seek(0)
        text = log.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{recipe.name}: nemo-ac plan failed:\n{text[-3000:]}")
    return wall, usage.ru_maxrss * 1024, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", choices=["full", "scaled"], default="full")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/plan_flagships"))
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plans = {}
    rows = [
        "| recipe | world | GPU | peak GiB per rank (largest terms) | fits (headroom GiB) | host GiB per node | TFLOP per "
        "rank per step (executed / model) | communication GB per rank per step | step s (bounds: fused .. eager) | MFU | tokens/s per GPU | dry run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, world in FLAGSHIPS:
        json_path = Path(tempfile.mkdtemp()) / "plan.json"
        wall, rss, _ = run_plan(ROOT / "recipes" / name, world, args.depth, json_path)
        plan = json.loads(json_path.read_text())
        plan["dry_run"]["process_wall_s"], plan["dry_run"]["process_peak_rss_bytes"] = wall, rss
        plans[name] = plan
        memory = plan["memory"]
        terms = sorted(memory["terms_bytes"].items(), key=lambda kv: -kv[1])[:3]
        largest = ", ".join(f"{term} {size / GiB:.1f}" for term, size in terms)
        by_dim: dict[str, float] = {}
        for c in plan["collectives"]:
            by_dim[c["dim"]] = by_dim.get(c["dim"], 0.0) + c["wire_bytes"] / 1e9
        comm = ", ".join(f"{dim} {gb:,.1f}" for dim, gb in sorted(by_dim.items()))
        flops = f"{plan['flops']['total'] / 1e12:,.0f} / {plan['flops']['model'] / 1e12:,.0f}"
        for e in plan["estimates"]:
            fits = f"{'yes' if e['fits'] else 'NO'} ({e['headroom_bytes'] / GiB:+.1f})"
            rows.append(
                f"| {name.removesuffix('.yaml')} | {world} | {e['gpu']} | {memory['peak_bytes'] / GiB:.1f} ({largest}) | "
                f"{fits} | {e['host_bytes_per_node'] / GiB:,.1f} | {flops} | {comm} | {e['step_s']:.2f} ({e['step_fused_s']:.2f} .. {e['step_eager_s']:.2f}) | "
                f"{e['mfu']:.1%} | {e['tokens_per_s_per_gpu']:,.0f} | {wall:.0f} s, {rss / GiB:.2f} GiB RSS |"
            )
        print(rows[-2], rows[-1], sep="\n", flush=True)
    out.with_suffix(".json").write_text(json.dumps(plans, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(rows) + "\n")
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
