"""Step-time overhead of nemo_ac's SAC workarounds: workarounds on vs off on the same model, data and layout.

    python benchmarks/workaround_overhead.py [--repeats 3] [--steps 24] [--warmup 4] [--backend aot_eager]
    GPU variant: python benchmarks/workaround_overhead.py --device cuda --dtype bfloat16 --backend inductor

"on" = ``activation_checkpointing.workarounds=true compile.forward_thread_context=true`` (fix #1: profiler ops
ignored by SAC + the FSDP-hook bracket; fix #2: the recompute runs under the forward thread's Dynamo config);
"off" = both false. Every launch is the tiny Qwen3-MoE recipe on 2 ranks (FSDP2, selective AC, compile ac_outer,
packed variable-length data, ``train.backward_on_thread=true``) with ``model.moe.separate_fsdp_unit=false``: with a
nested expert FSDP unit and the workarounds off the run can crash (the bug the workarounds fix), and a crash has no
step time. Launches alternate on, off, on, off, ... (``--repeats`` each) and share one inductor cache made fresh for
this invocation; a launch's step time is the median ``step_time_s`` of metrics.jsonl after ``--warmup`` steps.
Overhead = pooled median (on) / pooled median (off) - 1; noise = the largest relative spread between launches of
the same setting, and the range of the per-pair overheads (launch i on vs launch i off, run back to back). Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import add_common_args, device_overrides, launch_train, markdown_table, median_step_ms, write_json

SETTINGS = {
    "on": ["activation_checkpointing.workarounds=true", "compile.forward_thread_context=true"],
    "off": ["activation_checkpointing.workarounds=false", "compile.forward_thread_context=false"],
}


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"train.steps={args.steps}",
        "model.moe.separate_fsdp_unit=false",
        "activation_checkpointing.mode=selective",
        "compile.enabled=true",
        "compile.layout=ac_outer",
        f"compile.backend={args.backend}",
        "data.fixed_length=false",
        # On CUDA the autograd device thread runs backward anyway.
        f"train.backward_on_thread={str(args.device == 'cpu').lower()}",
        *device_overrides(device=args.device, dtype=args.dtype),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="launches per setting, alternating")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median (compiles)")
    parser.add_argument("--backend", default="aot_eager", help="compile.backend (inductor on GPU)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per launch")
    add_common_args(parser, default_out="workaround_overhead.json")
    args = parser.parse_args()
    started = time.perf_counter()
    launches: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="nemo_ac_bench_workarounds_") as tmp:
        for repeat in range(args.repeats):
            for setting, overrides in SETTINGS.items():
                launch = launch_train(
                    overrides=[*common_overrides(args), *overrides],
                    run_dir=Path(tmp) / f"{setting}_{repeat}",
                    timeout_s=args.timeout,
                    inductor_cache=Path(tmp) / "inductor_cache",
                )
                steady = [1000 * r["step_time_s"] for r in launch.records[args.warmup :]]
                launches.append(
                    {
                        "setting": setting,
                        "repeat": repeat,
                        "status": launch.status(),
                        "median_step_ms": median_step_ms(launch.records, skip=args.warmup),
                        "steady_step_ms": steady,
                        "final_loss": launch.records[-1]["loss"] if launch.records else None,
                        "wall_s": round(launch.wall_s, 1),
                    }
                )
                print(f"done: {setting} #{repeat} ({launch.wall_s:.0f} s): {launch.status()}", file=sys.stderr)

    summary: dict[str, dict[str, Any]] = {}
    for setting in SETTINGS:
        mine = [x for x in launches if x["setting"] == setting and x["median_step_ms"] is not None]
        pooled = [t for x in mine for t in x["steady_step_ms"]]
        medians = [x["median_step_ms"] for x in mine]
        summary[setting] = {
            "pooled_median_ms": statistics.median(pooled) if pooled else None,
            "launch_medians_ms": medians,
            "spread": (max(medians) - min(medians)) / min(medians) if len(medians) > 1 else None,
        }
    on, off = summary["on"]["pooled_median_ms"], summary["off"]["pooled_median_ms"]
    overhead = on / off - 1 if on and off else None
    pairs = [
        on_run["median_step_ms"] / off_run["median_step_ms"] - 1
        for on_run, off_run in zip(launches[0::2], launches[1::2])
        if on_run["median_step_ms"] and off_run["median_step_ms"]
    ]
    spreads = [s["spread"] for s in summary.values() if s["spread"] is not None]
    noise = max(spreads) if spreads else None

    rows = [
        [
            x["setting"],
            x["repeat"] + 1,
            x["median_step_ms"],
            x["final_loss"] and f"{x['final_loss']:.4f}",
            x["wall_s"],
            x["status"],
        ]
        for x in launches
    ]
    for setting, s in summary.items():
        spread = "—" if s["spread"] is None else f"{100 * s['spread']:.1f}% spread"
        rows.append([f"**{setting}** (pooled)", "all", s["pooled_median_ms"], "", "", spread])
    table = markdown_table(
        headers=["workarounds", "launch", "median step (ms)", "final loss", "launch wall (s)", "status"], rows=rows
    )
    verdict = (
        "overhead: n/a (a setting produced no step times)"
        if overhead is None
        else f"overhead of the workarounds: {100 * overhead:+.1f}% (noise: launches of one setting differ by up to "
        f"{'n/a' if noise is None else f'{100 * noise:.1f}%'}; per-pair overhead "
        f"{', '.join(f'{100 * p:+.1f}%' for p in pairs)})"
    )
    title = (
        f"tiny qwen3_moe, 2 ranks ({args.device}, {args.dtype}), selective AC, compile ac_outer ({args.backend}), "
        f"separate_fsdp_unit=false, backward on a thread, {args.steps} steps, median after step {args.warmup}"
    )
    print(title)
    print(table)
    print(verdict)
    write_json(
        args.out,
        payload={
            "title": title,
            "launches": launches,
            "summary": summary,
            "overhead": overhead,
            "noise": noise,
            "pairs": pairs,
        },
        table=f"{table}\n\n{verdict}",
        wall_s=time.perf_counter() - started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
