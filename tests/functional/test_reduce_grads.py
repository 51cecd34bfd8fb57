"""``parallel.fsdp.reduce_grads: last_micro_batch`` reduces once per step and trains exactly like the default.

One 2-rank launch (gloo, FSDP2 with expert parallel: the experts are nested FSDP units on their own mesh) trains the
tiny recipe in both modes with 2 micro batches per rank and counts FSDP2's reduce-scatters per step.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import ROOT, assert_close_rel, run_script

pytestmark = pytest.mark.functional
WORKER = ROOT / "tests" / "functional" / "workers" / "reduce_grads.py"


def test_last_micro_batch_reduces_once_per_step_with_the_same_losses(tmp_path):
    out = tmp_path / "out.json"
    overrides = [
        "parallel.ep=2",
        "train.steps=3",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "activation_checkpointing.mode=none",
    ]
    proc = run_script(WORKER, nproc=2, args=[str(out), *overrides], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    every, last = result["every_micro_batch"], result["last_micro_batch"]
    assert every["micro_batches"] == last["micro_batches"] == 2
    # Every unit with gradients reduce-scatters after each micro batch's backward, or once per step.
    per_micro_batch = every["reduce_scatters"][0] // 2
    assert per_micro_batch > 0
    assert every["reduce_scatters"] == [2 * per_micro_batch] * 3
    assert last["reduce_scatters"] == [per_micro_batch] * 3
    assert_close_rel(last["losses"], every["losses"], rel=1e-5)
    assert_close_rel(last["grad_norms"], every["grad_norms"], rel=1e-5)
