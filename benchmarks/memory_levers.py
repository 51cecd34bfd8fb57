"""The memory levers over a long run: loss curves side by side, each lever against the run without it.

    python benchmarks/memory_levers.py [--steps 120] [--out benchmarks/results/memory_levers.json]

The tiny GLM-4.5-Air recipe (2 gloo ranks, CP2 Ulysses, full AC + activation offload, fp32) trains ``--steps`` steps
from the same seed and data: with AdamW's states on the device and the whole logits (the reference), with the states
in host memory (``train.optimizer_offload=states``), with FSDP's shards, gradients and AdamW on the host
(``train.optimizer_offload=full``: FSDP2's CPUOffloadPolicy), and with the LM head + loss in 64-token chunks
(``train.loss_chunk_tokens=64``); and the reference on one rank (no CP, no offload), whose distance from the 2-rank
reference is what fp32 rounding alone grows into over these steps. Expected: both offloads give the reference's
losses bit for bit (the same AdamW arithmetic on every element, the same gradients); the chunked loss differs by fp32
rounding only (a sum over chunks instead of one reduction), which training amplifies like any other change of
summation order: about as far as the one-rank run, without a trend. Prints the table and writes JSON + markdown.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import RESULTS_DIR, ROOT, launch_train, markdown_table, write_json

RECIPE = ROOT / "recipes" / "tiny" / "glm_4_5_air_tiny.yaml"
RUNS = {
    "reference (states on device, whole logits)": ["train.optimizer_offload=none", "train.loss_chunk_tokens=0"],
    "optimizer_offload=states": ["train.optimizer_offload=states", "train.loss_chunk_tokens=0"],
    "optimizer_offload=full": ["train.optimizer_offload=full", "train.loss_chunk_tokens=0"],
    "loss_chunk_tokens=64": ["train.optimizer_offload=none", "train.loss_chunk_tokens=64"],
    # The yardstick for rounding: the reference's math on one rank (no CP, no offload: other summation orders).
    "reference on 1 rank": ["train.optimizer_offload=none", "train.loss_chunk_tokens=0", "parallel.cp=1",
                            "activation_checkpointing.offload=false"],
}  # fmt: skip
NPROC = {"reference on 1 rank": 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "memory_levers.json")
    args = parser.parse_args()
    started = time.perf_counter()
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, overrides) in enumerate(RUNS.items()):
            common = [f"train.steps={args.steps}", "train.warmup_steps=5", "logging.log_every=1"]
            launch = launch_train(
                overrides=[*common, *overrides],
                run_dir=Path(tmp) / str(index),
                recipe=RECIPE,
                nproc=NPROC.get(name, 2),
                timeout_s=3600,
            )
            if not launch.ok:
                raise SystemExit(f"{name}: {launch.status()}\n{launch.output_tail}")
            losses[name] = [record["loss"] for record in launch.records]
            print(f"{name}: {len(losses[name])} steps in {launch.wall_s:.0f} s", flush=True)
    reference = losses[next(iter(RUNS))]
    summary = {}
    for name, curve in losses.items():
        diffs = [abs(a - b) for a, b in zip(curve, reference, strict=True)]
        summary[name] = {
            "final_loss": curve[-1],
            "max_abs_diff": max(diffs),
            "max_rel_diff": max(d / abs(r) for d, r in zip(diffs, reference, strict=True)),
            "bitwise_equal_steps": sum(d == 0 for d in diffs),
        }
    rows = [
        [name, f"{s['final_loss']:.6f}", f"{s['max_abs_diff']:.2e}", f"{s['max_rel_diff']:.2e}",
         f"{s['bitwise_equal_steps']} / {args.steps}"]
        for name, s in summary.items()
    ]  # fmt: skip
    table = markdown_table(
        headers=["run", "final loss", "max abs loss diff vs reference", "max rel diff", "bitwise equal steps"],
        rows=rows,
    )
    every = max(args.steps // 12, 1)
    curve_rows = [[step + 1, *(f"{losses[name][step]:.6f}" for name in RUNS)] for step in range(0, args.steps, every)]
    curves = markdown_table(headers=["step", *RUNS], rows=curve_rows)
    print(table + "\n\n" + curves)
    write_json(
        args.out,
        payload={"steps": args.steps, "losses": losses, "summary": summary},
        table=table,
        wall_s=time.perf_counter() - started,
    )
    args.out.with_suffix(".md").write_text(
        f"# Memory levers over {args.steps} steps (tiny GLM-4.5-Air, 2 gloo ranks, fp32)\n\n"
        f"`python benchmarks/memory_levers.py --steps {args.steps}`\n\n{table}\n\nLoss every {every} steps:\n\n{curves}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
