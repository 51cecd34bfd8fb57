"""Step time and compile counts of the tiny MoE recipe: eager vs compile_outer vs ac_outer, side by side.

    python benchmarks/compile_layouts.py [--nproc 2] [--steps 12] [--backend inductor] [--rows eager,compile_outer,...]

Each row is one real ``torchrun`` launch of ``nemo_ac.train`` (gloo on CPU, FSDP2, selective AC, packed variable-length
data, backward on a worker thread as on a GPU's autograd thread); the numbers come from the run's metrics.jsonl.
compile_outer needs blocks without a nested FSDP unit, so every row runs with ``model.moe.separate_fsdp_unit=false``
except the ``*_nested`` rows (experts as their own FSDP unit, the layout ``auto`` compiles as ac_outer). Step time is
the median over steps 3.. (steps 1-2 compile). Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"

FLAT = ["model.moe.separate_fsdp_unit=false"]
ROWS = {
    "eager": [*FLAT, "compile.enabled=false"],
    "compile_outer": [*FLAT, "compile.enabled=true", "compile.layout=compile_outer"],
    "ac_outer": [*FLAT, "compile.enabled=true", "compile.layout=ac_outer"],
    "eager_nested": ["compile.enabled=false"],
    "ac_outer_nested": ["compile.enabled=true", "compile.layout=auto"],
}
COUNTS = ("compiles_fwd", "compiles_bwd", "recompiles_fwd", "recompiles_bwd", "graph_breaks", "bwd_graphs")


def launch(name: str, overrides: list[str], *, args: argparse.Namespace, run_dir: Path) -> dict:
    common = [
        f"train.steps={args.steps}",
        "data.fixed_length=false",
        "train.backward_on_thread=true",
        f"activation_checkpointing.mode={args.ac}",
        f"compile.backend={args.backend}",
        f"compile.dynamic={args.dynamic}",
        f"logging.run_dir={run_dir}",
        "logging.progress_bar=never",
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    command += ["-m", "nemo_ac.train", str(RECIPE), *common, *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        print(f"{name}: failed ({proc.returncode})\n{(proc.stdout + proc.stderr)[-3000:]}", file=sys.stderr)
        return {"name": name, "failed": True}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [r["step_time_s"] for r in records[2:]] or [records[-1]["step_time_s"]]
    last = records[-1]
    return {
        "name": name,
        "step_ms": 1000 * statistics.median(steady),
        "first_two_s": sum(r["step_time_s"] for r in records[:2]),
        "wall_s": wall,
        "loss": last["loss"],
        "fallbacks": last.get("eager_fallbacks", 0),
        "after_step_2": sum(last.get(k, 0) - records[min(1, len(records) - 1)].get(k, 0) for k in COUNTS),
        **{k: last.get(k, 0) for k in COUNTS},
    }


def table(results: list[dict]) -> str:
    header = (
        "| layout | median step (ms) | steps 1-2 (s) | compiles fwd / bwd thread | recompiles fwd / bwd | graph breaks"
        " | bwd graphs | new compiles after step 2 | eager fallbacks | final loss |"
    )
    lines = [header, "|" + " --- |" * header.count(" | ") + " --- |"]
    for r in results:
        if r.get("failed"):
            lines.append(f"| {r['name']} | failed |" + " |" * 8)
            continue
        lines.append(
            f"| {r['name']} | {r['step_ms']:.0f} | {r['first_two_s']:.1f} | {r['compiles_fwd']} / {r['compiles_bwd']}"
            f" | {r['recompiles_fwd']} / {r['recompiles_bwd']} | {r['graph_breaks']} | {r['bwd_graphs']}"
            f" | {r['after_step_2']} | {r['fallbacks']} | {r['loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--dynamic", default="null", choices=["null", "true", "false"], help="compile.dynamic")
    parser.add_argument(
        "--ac", default="selective", choices=["full", "selective"], help="activation_checkpointing.mode"
    )
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma separated subset of {list(ROWS)}")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="nemo_ac_bench_") as tmp:
        for name in args.rows.split(","):
            results.append(launch(name, ROWS[name], args=args, run_dir=Path(tmp) / name))
            print(f"done: {name}", file=sys.stderr, flush=True)
    print(
        f"tiny qwen3_moe, {args.nproc} gloo ranks, {args.steps} steps, backend {args.backend}, "
        f"dynamic {args.dynamic}, {args.ac} AC"
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
