"""The optimizer-memory policies against fp32 AdamW on the device: loss curves, state bytes, resume.

Each policy trains the tiny Qwen3 MoE recipe for 120 steps on 2 gloo processes (FSDP2, fp32 master weights, compile
off so the launches stay short), from the same seed on the same rows:

- ``fp32``: the default, torch's AdamW with fp32 moments on the device (the reference);
- ``bf16 moments``: ``train.optimizer_state_dtype=bfloat16`` (stochastic rounding, trainer/adamw_low_precision.py);
- ``fp8 moments``: ``train.optimizer_state_dtype=float8`` (e4m3 codes, a scale per 128 elements of a row,
  trainer/adamw_fp8_states.py);
- ``host states``: ``train.optimizer_offload=states`` (fp32 moments in host memory, bitwise the reference);
- ``full offload``: ``train.optimizer_offload=full`` (FSDP2's CPUOffloadPolicy, the step on the host);
- ``full offload + bf16 moments``: both;
- ``fp32 masters, bf16 compute``: ``parallel.fsdp.param_dtype=bfloat16`` (the flagships' compute), the reference of
  the two bf16-master rows below, which need bf16 compute;
- ``bf16 masters``: ``train.master_dtype=bfloat16`` (parameters and gradients in bf16, stochastically rounded update);
- ``bf16 masters + bf16 moments``: 8 bytes per parameter in all, NeMo Automodel's benchmark setting;
- ``bf16 masters + fp8 moments``: 6.06 bytes per parameter in all.

Printed per policy: the largest loss difference from its reference over the 120 steps (absolute, and relative to
the first loss), the mean loss of the last 20 steps beside the reference's (single steps swing by 10% from row to
row), whether the curve is bitwise the reference's, and the optimizer-state and parameter + gradient bytes per
rank on the device at the optimizer step by the dry run (``nemo-ac plan``'s memory model on the same recipe). Then
the bf16 policy is stopped after step 60 (a DCP checkpoint) and resumed to 120: its curve must be bitwise the
uninterrupted one (the rounding noise is seeded by parameter and step).

    python benchmarks/optimizer_policies.py            # ~6 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import RESULTS_DIR, TINY_RECIPE, cell, launch_train, markdown_table, write_json

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.run import SimulationOptions, simulate

STEPS = 120
COMMON = [f"train.steps={STEPS}", "compile.enabled=false"]
REFERENCE, BF16_REFERENCE = "fp32 (reference)", "fp32 masters, bf16 compute"
BF16_COMPUTE = "parallel.fsdp.param_dtype=bfloat16"
# name -> (overrides, the policy its curve is compared with)
POLICIES = {
    REFERENCE: ([], REFERENCE),
    "bf16 moments": (["train.optimizer_state_dtype=bfloat16"], REFERENCE),
    "fp8 moments": (["train.optimizer_state_dtype=float8"], REFERENCE),
    "host states": (["train.optimizer_offload=states"], REFERENCE),
    "full offload": (["train.optimizer_offload=full"], REFERENCE),
    "full offload + bf16 moments": (
        ["train.optimizer_offload=full", "train.optimizer_state_dtype=bfloat16"],
        REFERENCE,
    ),
    BF16_REFERENCE: ([BF16_COMPUTE], BF16_REFERENCE),
    "bf16 masters": ([BF16_COMPUTE, "train.master_dtype=bfloat16"], BF16_REFERENCE),
    "bf16 masters + bf16 moments": (
        [BF16_COMPUTE, "train.master_dtype=bfloat16", "train.optimizer_state_dtype=bfloat16"],
        BF16_REFERENCE,
    ),
    "bf16 masters + fp8 moments": (
        [BF16_COMPUTE, "train.master_dtype=bfloat16", "train.optimizer_state_dtype=float8"],
        BF16_REFERENCE,
    ),
}


def device_bytes(overrides: list[str]) -> tuple[int, int]:
    """The dry run's optimizer states, and parameters + gradients, on the device at the optimizer step (2 ranks,
    rank 0)."""
    recipe = load_recipe(TINY_RECIPE, [*COMMON, *overrides])
    result = simulate(recipe, validate_recipe(recipe, world_size=2), SimulationOptions(world_size=2))
    terms = result.measurement.phase_peaks["optimizer"].terms
    return terms.get("optimizer states", 0), terms.get("parameters", 0) + terms.get("gradients", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS_DIR / "optimizer_policies.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="nemo_ac_optimizer_policies_"))
    losses: dict[str, list[float]] = {}
    rows, payload = [], {}
    for name, (overrides, reference_name) in POLICIES.items():
        launch = launch_train(overrides=[*COMMON, *overrides], run_dir=work / name.replace(" ", "_"))
        if not launch.ok:
            raise SystemExit(f"{name}: {launch.status()}\n{launch.output_tail}")
        losses[name] = [record["loss"] for record in launch.records]
        reference = losses[reference_name]
        worst = max(abs(a - b) for a, b in zip(losses[name], reference, strict=True))
        state_bytes, weight_bytes = device_bytes(overrides)
        payload[name] = {"overrides": overrides, "reference": reference_name, "losses": losses[name],
                         "max_abs_loss_diff": worst, "device_optimizer_state_bytes": state_bytes,
                         "device_parameter_gradient_bytes": weight_bytes}  # fmt: skip
        tail, tail_reference = statistics.mean(losses[name][-20:]), statistics.mean(reference[-20:])
        payload[name]["last_20_mean_loss"] = tail
        rows.append([
            name, " ".join(overrides) or "-", reference_name, f"{worst:.2e}", f"{worst / reference[0]:.2e}", cell(tail_reference, digits=4),
            cell(tail, digits=4), f"{tail / tail_reference - 1:+.2%}", "yes" if losses[name] == reference else "no",
            f"{state_bytes:,}", f"{weight_bytes:,}",
        ])  # fmt: skip
    # bf16 moments: 60 steps and a checkpoint, then resumed to 120, against the uninterrupted curve.
    resume_dir = work / "bf16_resume"
    checkpoint = ["checkpoint.enabled=true", f"checkpoint.dir={resume_dir / 'ckpt'}", "checkpoint.every_n_steps=60",
                  "checkpoint.resume=auto"]  # fmt: skip
    bf16 = [*COMMON, *POLICIES["bf16 moments"][0], *checkpoint]
    first = launch_train(overrides=[*bf16, "train.fail_after_step=60"], run_dir=resume_dir)
    resumed = launch_train(overrides=bf16, run_dir=resume_dir)
    if not resumed.ok:
        raise SystemExit(f"resume: {resumed.status()}\n{resumed.output_tail}")
    resumed_losses = [record["loss"] for record in resumed.records]
    bitwise = resumed_losses == losses["bf16 moments"]
    payload["bf16_resume"] = {"first_launch_exit": first.returncode, "losses": resumed_losses, "bitwise": bitwise}
    headers = ["policy", "overrides", "compared with", "max abs loss diff", "/ first loss", "last-20 mean there",
               "last-20 mean", "difference", "bitwise there", "device optimizer-state bytes per rank (dry run)",
               "device parameter + gradient bytes per rank (dry run)"]  # fmt: skip
    table = markdown_table(headers=headers, rows=rows)
    summary = (
        f"{table}\n\nbf16 moments stopped after step 60 (DCP checkpoint) and resumed to step {STEPS}: the curve "
        f"{'is' if bitwise else 'is NOT'} bitwise the uninterrupted one ({len(resumed_losses)} steps)."
    )
    print(summary)
    Path(args.out).with_suffix(".md").write_text(
        f"# Optimizer-memory policies: tiny Qwen3 MoE, 2 gloo ranks, {STEPS} steps\n\n"
        f"`python benchmarks/optimizer_policies.py`\n\n{summary}\n"
    )
    write_json(Path(args.out), payload=payload, table=summary, wall_s=time.perf_counter() - started)


if __name__ == "__main__":
    main()
