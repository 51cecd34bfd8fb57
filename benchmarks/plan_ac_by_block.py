"""AC per block kind on NeMo Automodel's Nemotron V3 Super benchmark shape: the dry run's peak and step estimate.

    python benchmarks/plan_ac_by_block.py [--out benchmarks/results/plan_ac_by_block]

Automodel's published shape: 64 H100, EP64, 2 rows of 4,096 tokens per micro batch, global batch 512 (measured by the
peer on its own software: 7.286 s per step, 4,497 tokens/s per GPU). Each row is ``nemo-ac plan
recipes/nemotron_super_v3_te_deepep.yaml --world-size 64 --gpu h100-80gb`` at that shape with the row's AC overrides
(each block kind's ``activation_checkpointing.by_block.KIND`` and ``selective.save_communication``), full depth. Every figure is the dry
run's estimate, not a measurement; docs/sac.md shows the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nemo_ac.simulate.cli import dry_run
from nemo_ac.simulate.gpus import GPUS
from nemo_ac.simulate.report import PlanReport

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/nemotron_super_v3_te_deepep.yaml"
SHAPE = ("data.seq_len=4096", "train.global_batch_size=512", "train.micro_batch_size=2")
BY_BLOCK = "activation_checkpointing.by_block"
KINDS = ("ssm", "moe", "softmax_attention")


def ac(label: str, ssm: str, moe: str, attention: str, *, save_communication: bool = True) -> tuple:
    """A row: every block kind's AC mode spelled out (whatever the recipe sets) and selective.save_communication."""
    modes = dict(zip(KINDS, (ssm, moe, attention), strict=True))
    overrides = [f"{BY_BLOCK}.{kind}={mode}" for kind, mode in modes.items()]
    overrides.append(f"activation_checkpointing.selective.save_communication={str(save_communication).lower()}")
    return label, tuple(overrides)


ROWS = (
    ac("full", "full", "full", "full"),
    ac("attention none", "full", "full", "none"),
    ac("ssm selective", "selective", "full", "full"),
    ac("ssm, attention selective", "selective", "full", "selective"),
    ac("ssm none", "none", "full", "full"),
    ac("moe selective", "full", "selective", "full"),
    ac("moe selective, collectives recomputed", "full", "selective", "full", save_communication=False),
    ac("moe, attention selective, collectives recomputed", "full", "selective", "selective", save_communication=False),
    ac("moe, attention selective (the recipe)", "full", "selective", "selective"),
    ac("selective", "selective", "selective", "selective"),
    ac("none", "none", "none", "none"),
)  # fmt: skip
H100 = GPUS["h100-80gb"]
GiB = 2**30


def run_row(label: str, overrides: tuple[str, ...]) -> dict:
    simulation = dry_run(str(RECIPE), [*SHAPE, *overrides], world_size=64)
    report = PlanReport.build(simulation, [H100])
    estimate, fit = report.estimates[0], report.fits[0]
    return {
        "label": label,
        "overrides": list(overrides),
        "peak_bytes": fit.peak_bytes,
        "fits": fit.fits,
        "recompute_flops": simulation.measurement.counts.flops["recompute"],
        "step_s": estimate.step_s,
        "compute_s": estimate.compute_s,
        "blocking_comm_s": estimate.exposed_s,
        "tokens_per_s_per_gpu": simulation.tokens_per_step / estimate.step_s / 64,
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| AC | peak GiB per rank | recompute PFLOP per rank per step | step s | tokens/s per GPU |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{r['peak_bytes'] / GiB:.2f}" + ("" if r["fits"] else " (does not fit)")
        lines.append(
            f"| {r['label']} | {peak} | {r['recompute_flops'] / 1e15:.3f} | {r['step_s']:.2f} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/plan_ac_by_block"))
    args = parser.parse_args()
    rows = []
    for label, overrides in ROWS:
        rows.append(run_row(label, overrides))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
