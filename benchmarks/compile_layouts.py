"""Step time and compile counts of the tiny MoE recipe: eager vs compile_outer vs ac_outer, side by side.

    python benchmarks/compile_layouts.py [--nproc 2] [--steps 12] [--backend inductor] [--rows eager,compile_outer,...]
    GPU variant: python benchmarks/compile_layouts.py --device cuda --dtype bfloat16

Each row is one real ``torchrun`` launch of ``nemo_ac.train`` (gloo on CPU, FSDP2, selective AC, packed variable-length
data, backward on a worker thread as on a GPU's autograd thread); the numbers come from the run's metrics.jsonl.
compile_outer needs blocks without a nested FSDP unit, so every row runs with ``model.moe.separate_fsdp_unit=false``
except the ``*_nested`` rows (experts as their own FSDP unit, the layout ``auto`` compiles as ac_outer). Step time is
the median over steps 3.. (steps 1-2 compile), also as a ratio to the eager row of the same FSDP layout (eager for
the flat rows, eager_nested for ac_outer_nested). Each launch gets a fresh inductor cache (cold compiles); results
also go to ``--out`` as JSON. Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    COMPILE_COUNTS,
    add_common_args,
    device_overrides,
    launch_train,
    markdown_table,
    median_step_ms,
    write_json,
)

FLAT = ["model.moe.separate_fsdp_unit=false"]
ROWS = {
    "eager": [*FLAT, "compile.enabled=false"],
    "compile_outer": [*FLAT, "compile.enabled=true", "compile.layout=compile_outer"],
    "ac_outer": [*FLAT, "compile.enabled=true", "compile.layout=ac_outer"],
    "eager_nested": ["compile.enabled=false"],
    "ac_outer_nested": ["compile.enabled=true", "compile.layout=auto"],
}
DEFAULT_ROWS = ["eager", "compile_outer", "ac_outer"]  # the *_nested rows on request (5 minute budget on 2 CPUs)


def launch(name: str, overrides: list[str], *, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    common = [
        f"train.steps={args.steps}",
        "data.fixed_length=false",
        # On CUDA the autograd device thread runs backward anyway.
        f"train.backward_on_thread={str(args.device == 'cpu').lower()}",
        f"activation_checkpointing.mode={args.ac}",
        f"compile.backend={args.backend}",
        f"compile.dynamic={args.dynamic}",
        *device_overrides(device=args.device, dtype=args.dtype),
    ]
    result = launch_train(overrides=[*common, *overrides], run_dir=run_dir, nproc=args.nproc, timeout_s=args.timeout)
    records = result.records
    if not result.ok or not records:
        print(f"{name}: {result.status()}\n{result.output_tail[-3000:]}", file=sys.stderr)
        return {"name": name, "failed": True, "status": result.status(), "wall_s": result.wall_s}
    last = records[-1]
    return {
        "name": name,
        "step_ms": median_step_ms(records, skip=2) or median_step_ms(records, skip=0),
        "first_two_s": sum(r["step_time_s"] for r in records[:2]),
        "wall_s": result.wall_s,
        "loss": last["loss"],
        "fallbacks": last.get("eager_fallbacks", 0),
        "after_step_2": sum(last.get(k, 0) - records[min(1, len(records) - 1)].get(k, 0) for k in COMPILE_COUNTS),
        **{k: last.get(k, 0) for k in COMPILE_COUNTS},
    }


def table(results: list[dict[str, Any]]) -> str:
    """One markdown row per layout; step time also as a ratio to the first eager row of the same FSDP layout."""
    eager = {
        r["name"].removeprefix("eager"): r["step_ms"]
        for r in results
        if r["name"].startswith("eager") and not r.get("failed")
    }
    headers = [
        "layout",
        "median step (ms)",
        "step time vs eager",
        "steps 1-2 (s)",
        "compiles fwd / bwd thread",
        "recompiles fwd / bwd",
        "graph breaks",
        "bwd graphs",
        "new compiles after step 2",
        "eager fallbacks",
        "final loss",
    ]
    rows = []
    for r in results:
        if r.get("failed"):
            rows.append([r["name"], r["status"], *[None] * (len(headers) - 2)])
            continue
        base = eager.get("_nested" if r["name"].endswith("_nested") else "")
        rows.append(
            [
                r["name"],
                f"{r['step_ms']:.0f}",
                f"{r['step_ms'] / base:.2f}" if base else None,
                r["first_two_s"],
                f"{r['compiles_fwd']} / {r['compiles_bwd']}",
                f"{r['recompiles_fwd']} / {r['recompiles_bwd']}",
                r["graph_breaks"],
                r["bwd_graphs"],
                r["after_step_2"],
                r["fallbacks"],
                f"{r['loss']:.4f}",
            ]
        )
    return markdown_table(headers=headers, rows=rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--dynamic", default="null", choices=["null", "true", "false"], help="compile.dynamic")
    parser.add_argument(
        "--ac", default="selective", choices=["full", "selective"], help="activation_checkpointing.mode"
    )
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma separated subset of {list(ROWS)}")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per launch")
    add_common_args(parser, default_out="compile_layouts.json")
    args = parser.parse_args()
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="nemo_ac_bench_") as tmp:
        for name in args.rows.split(","):
            results.append(launch(name, ROWS[name], args=args, run_dir=Path(tmp) / name))
            print(f"done: {name} ({results[-1]['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    title = (
        f"tiny qwen3_moe, {args.nproc} ranks ({args.device}, {args.dtype}), {args.steps} steps, backend "
        f"{args.backend}, dynamic {args.dynamic}, {args.ac} AC, packed variable-length rows"
    )
    rendered = table(results)
    print(title)
    print(rendered)
    write_json(
        args.out, payload={"title": title, "rows": results}, table=rendered, wall_s=time.perf_counter() - started
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
