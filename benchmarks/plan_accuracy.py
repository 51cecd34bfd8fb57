"""How close ``nemo-ac plan`` is to a real run of the same step: the table of docs/planning.md.

    python benchmarks/plan_accuracy.py [--out benchmarks/results/plan_accuracy]

For each case (the four tiny recipes at their own layouts, HSDP 2x2, ring cp2) one real gloo run of one step
(``torchrun -m nemo_ac.simulate.measure``) and the dry run of every rank (``nemo_ac.simulate.simulate``) in this
process; per rank: tracked peak predicted / measured, FLOPs predicted / FlopCounterMode over the real step, collective
bytes equal or not. Both sides use ``model.moe.force_balanced_routing`` and no torch.compile. Writes JSON and
markdown beside each other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.accuracy import ACCURACY_CASES, ACCURACY_OVERRIDES, compare, read_measured
from nemo_ac.simulate.run import SimulationOptions, simulate

ROOT = Path(__file__).resolve().parents[1]
COMMON = list(ACCURACY_OVERRIDES)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/plan_accuracy"))
    args = parser.parse_args()
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        for name, (recipe_path, nproc, overrides) in ACCURACY_CASES.items():
            directory = Path(tmp) / name.replace(" ", "_")
            recipe_file = ROOT / "recipes" / recipe_path
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       "-m", "nemo_ac.simulate.measure", str(recipe_file), "--out", str(directory), *COMMON,
                       *overrides]  # fmt: skip
            subprocess.run(command, env=env, check=True, capture_output=True, cwd=tmp)
            recipe = load_recipe(recipe_file, [*COMMON, *overrides])
            layout = validate_recipe(recipe, world_size=nproc)
            for rank in range(nproc):
                sim = simulate(recipe, layout, SimulationOptions(world_size=nproc, micro_batch_limit=None, rank=rank))
                c = compare(sim, read_measured(directory, rank))
                rows.append({"case": name, "ranks": nproc, **c.__dict__, "peak_ratio": c.peak_ratio,
                             "flops_ratio": c.flops_ratio})  # fmt: skip
                print(f"{name:<26} {c.line()}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=list) + "\n")
    lines = [
        "| case | ranks | rank | peak predicted / measured (bytes) | ratio | FLOPs predicted / FlopCounterMode | ratio | "
        "collective bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['ranks']} | {r['rank']} | {r['predicted_peak']:,} / {r['measured_peak']:,} | "
            f"{r['peak_ratio']:.4f} | {r['predicted_flops']:,} / {r['flop_counter_flops']:,} | {r['flops_ratio']:.4f} | "
            f"{'equal' if r['collectives_equal'] else 'differ'} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
