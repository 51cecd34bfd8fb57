"""Command-line options of ``nemo-ac doctor`` (no torch import: the CLI builds its parser before any command runs)."""

from __future__ import annotations

import argparse

# The probes, in the order the table lists them (runner.PROBES holds what each one runs).
PROBE_NAMES = (
    "upstream_profiler_ignore",
    "sac_profiler_ops",
    "sac_fsdp_prefetch",
    "thread_config",
    "recompute_thread",
    "sac_compiled_regions",
    "dynamic_ints",
    "grouped_mm_fake",
    "softplus_layout",
    "rendezvous_restart",
)


def add_doctor_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the probes run (default cpu)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--only", nargs="+", choices=PROBE_NAMES, metavar="PROBE", help=f"of {', '.join(PROBE_NAMES)}")
    parser.add_argument(
        "--assume-torch-version",
        metavar="VERSION",
        help="decide nemo_ac's version gates as for this torch (e.g. 2.12.0); the probes run on the installed one",
    )
    return parser
