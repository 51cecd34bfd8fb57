"""The EP dispatcher and the Ulysses / ring attention ops on 2 real gloo ranks equal one-process references
(values and gradients, fp64), including uneven all-to-all splits with an empty split and an expert with no token,
the ring op compiled with ``fullgraph=True``, and Ulysses around Gated DeltaNet and Mamba-2 mixers (their torch ops
and the mixer kernels' custom ops). One launch; the checks live in workers/ep_cp_ops.py."""

from __future__ import annotations

import pytest

from tests.launch import ROOT, run_script

pytestmark = pytest.mark.functional

WORKER = ROOT / "tests" / "functional" / "workers" / "ep_cp_ops.py"
CHECKS = [
    "ep",
    "ulysses nkv=2",
    "ulysses nkv=1",
    "ring",
    "ring_compiled",
    "ulysses_linear_attention",
    "ulysses_mamba",
    "ulysses_fla_op",  # the mixer kernels' custom ops (CPU body: the torch reference) as Ulysses' inner op
    "ulysses_mamba_ssm_op",
]


def test_ep_and_cp_ops_match_single_process_references() -> None:
    proc = run_script(WORKER, nproc=2)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    for rank in (0, 1):
        for check in CHECKS:
            assert f"rank {rank}: ok {check}" in output, output[-6000:]
