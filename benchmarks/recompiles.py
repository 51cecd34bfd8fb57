"""Compiles per thread with packed variable-length data under CP ring/ulysses: the forward-thread context, on vs off.

    python benchmarks/recompiles.py [--rows a,b,...] [--steps 10] [--backend aot_eager] [--out PATH.json]
    GPU variant: python benchmarks/recompiles.py --device cuda --dtype bfloat16 --backend inductor

Each row is one real ``torchrun`` launch (2 ranks, ``parallel.cp=2``, FSDP2, selective AC, ``data.fixed_length=false``
so every micro batch has another length and ring slice sizes) of the tiny Qwen3-MoE recipe; the numbers are the
cumulative per-thread compile counts (``compiles_fwd`` / ``compiles_bwd``) of the run's metrics.jsonl at steps 1, 3
and the last step, the eager fallbacks, and the new compiles after step 3 (warm-up: the first compile plus the
automatic-dynamic recompile). A run that crashes or times out is a row with its first error line, not a crash here.

Backward runs on the caller thread (as on CPU), or on a worker thread that misses the forward's compile cache
(benchmarks/_forced_miss_train.py: another intra-op thread count fails Dynamo's global-state guard, so the ac_outer
recompute compiles on that thread, as it does on the CUDA autograd device thread). ``compile.forward_thread_context``
(fix #2) makes that recompute run under the forward thread's Dynamo config (dynamic ints, scalar outputs, limits).
With ``--device cuda`` the "worker" rows run the plain trainer: the autograd device thread is the worker.

The default backend is aot_eager (Dynamo + AOTAutograd, no codegen): the compile/recompile decisions are Dynamo's
and the same as with inductor, but a cold inductor compile of ring attention takes minutes per row on 2 CPU cores.
Not a test: nothing here is asserted.
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
    ROOT,
    Launch,
    add_common_args,
    device_overrides,
    launch_train,
    markdown_table,
    write_json,
)

FORCED_MISS = ROOT / "benchmarks" / "_forced_miss_train.py"

# name -> (cp_type, layout, backward thread, forward-thread context)
ROWS: dict[str, tuple[str, str, str, bool]] = {
    "ring_compile_outer_caller": ("ring", "compile_outer", "caller", True),
    "ring_ac_outer_caller": ("ring", "ac_outer", "caller", True),
    "ring_ac_outer_worker_ctx_on": ("ring", "ac_outer", "worker (forced miss)", True),
    "ring_ac_outer_worker_ctx_off": ("ring", "ac_outer", "worker (forced miss)", False),
    "ulysses_ac_outer_worker_ctx_on": ("ulysses", "ac_outer", "worker (forced miss)", True),
    "ulysses_ac_outer_worker_ctx_off": ("ulysses", "ac_outer", "worker (forced miss)", False),
    # Not in the default set (time budget): a plain worker thread hits the forward's cache on CPU.
    "ring_ac_outer_worker_plain_ctx_off": ("ring", "ac_outer", "worker (plain)", False),
    "ulysses_compile_outer_caller": ("ulysses", "compile_outer", "caller", True),
}
# Five launches, about 4.7 minutes on 2 idle CPU cores; ring_ac_outer_caller (the same forward counts as the worker
# rows, no backward thread) and the rows above run with --rows.
DEFAULT_ROWS = [name for name in list(ROWS)[:6] if name != "ring_ac_outer_caller"]
CHECKPOINTS = (1, 3)  # plus the last step


def overrides_for(name: str, *, args: argparse.Namespace) -> tuple[list[str], Path | None]:
    """Recipe overrides and the entry script (None: ``-m nemo_ac.train``) of one row."""
    cp_type, layout, backward, context = ROWS[name]
    out = [
        f"train.steps={args.steps}",
        "parallel.cp=2",
        f"parallel.cp_type={cp_type}",
        "data.fixed_length=false",
        "activation_checkpointing.mode=selective",
        "compile.enabled=true",
        f"compile.layout={layout}",
        f"compile.backend={args.backend}",
        f"compile.forward_thread_context={str(context).lower()}",
        *device_overrides(device=args.device, dtype=args.dtype),
    ]
    if layout == "compile_outer":
        out.append("model.moe.separate_fsdp_unit=false")  # compile(AC(block)) needs no nested FSDP unit
    entry = None
    if backward.startswith("worker"):
        if args.device == "cuda":
            out.append("train.backward_on_thread=false")  # the autograd device thread is the worker
        else:
            out.append("train.backward_on_thread=true")
            entry = FORCED_MISS if "forced" in backward else None
    return out, entry


def at_step(records: list[dict[str, Any]], step: int) -> dict[str, Any] | None:
    return next((r for r in records if r.get("step") == step), None)


def summarize(name: str, launch: Launch, *, steps: int) -> dict[str, Any]:
    cp_type, layout, backward, context = ROWS[name]
    counts = {}
    for step in (*CHECKPOINTS, steps):
        record = at_step(launch.records, step)
        counts[step] = None if record is None else (record.get("compiles_fwd", 0), record.get("compiles_bwd", 0))
    last = launch.records[-1] if launch.records else {}
    warm = at_step(launch.records, CHECKPOINTS[-1])
    after_warmup = None
    if warm is not None and launch.records[-1]["step"] > warm["step"]:
        after_warmup = sum(last.get(k, 0) - warm.get(k, 0) for k in ("compiles_fwd", "compiles_bwd"))
    return {
        "name": name,
        "cp_type": cp_type,
        "layout": layout,
        "backward": backward,
        "forward_thread_context": context,
        "compiles_fwd_bwd_at_step": {str(k): v for k, v in counts.items()},
        "steps_done": len(launch.records),
        "compiles_fwd_bwd_at_last_step": (last.get("compiles_fwd", 0), last.get("compiles_bwd", 0)) if last else None,
        "per_step": [{k: r.get(k) for k in ("step", "step_time_s", "loss", *COMPILE_COUNTS)} for r in launch.records],
        "new_compiles_after_step_3": after_warmup,
        "recompiles_fwd_bwd": (last.get("recompiles_fwd"), last.get("recompiles_bwd")) if last else None,
        "eager_fallbacks": last.get("eager_fallbacks") if last else None,
        "final_loss": last.get("loss"),
        "status": launch.status(),
        "wall_s": round(launch.wall_s, 1),
        "error": launch.error,
    }


def render(results: list[dict[str, Any]], *, steps: int) -> str:
    headers = [
        "row",
        "CP",
        "layout",
        "backward thread",
        "fwd-thread ctx",
        *[f"compiles fwd / bwd @ step {s}" for s in (*CHECKPOINTS, steps)],
        f"new compiles steps 4-{steps}",
        "eager fallbacks",
        "status",
    ]
    rows = []
    for r in results:
        last, done = r["compiles_fwd_bwd_at_last_step"], r["steps_done"]
        reached = "—" if last is None else f"— (step {done}: {last[0]} / {last[1]})"  # a step the run never reached
        per_step = [reached if v is None else f"{v[0]} / {v[1]}" for v in r["compiles_fwd_bwd_at_step"].values()]
        rows.append(
            [
                r["name"],
                r["cp_type"],
                r["layout"],
                r["backward"],
                "on" if r["forward_thread_context"] else "off",
                *per_step,
                r["new_compiles_after_step_3"],
                r["eager_fallbacks"],
                r["status"],
            ]
        )
    return markdown_table(headers=headers, rows=rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma separated subset of {list(ROWS)}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="aot_eager", help="compile.backend (inductor on GPU)")
    parser.add_argument("--timeout", type=float, default=200.0, help="seconds per launch")
    add_common_args(parser, default_out="recompiles.json")
    args = parser.parse_args()
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="nemo_ac_bench_recompiles_") as tmp:
        for name in args.rows.split(","):
            overrides, entry = overrides_for(name, args=args)
            # The forced-miss backward thread runs 2 OpenMP threads per rank: no spin-waiting on 2 shared cores.
            env = {"OMP_WAIT_POLICY": "PASSIVE"} if entry is not None else None
            launch = launch_train(
                overrides=overrides, run_dir=Path(tmp) / name, entry=entry, timeout_s=args.timeout, env=env
            )
            results.append(summarize(name, launch, steps=args.steps))
            print(f"done: {name} ({launch.wall_s:.0f} s): {launch.status()}", file=sys.stderr, flush=True)
    title = (
        f"tiny qwen3_moe, 2 ranks ({args.device}, {args.dtype}), cp=2, selective AC, packed variable-length rows, "
        f"{args.steps} steps, backend {args.backend}"
    )
    table = render(results, steps=args.steps)
    print(title)
    print(table)
    write_json(args.out, payload={"title": title, "rows": results}, table=table, wall_s=time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
