"""``nemo-ac doctor`` end to end, run once per session: every probe, the 2-process one included, on this torch.

The verdicts come from the command's own JSON (``python -m nemo_ac.doctor --json``) and must agree with nemo_ac's
gate table (``nemo_ac/workarounds/gates.py``) on whatever torch runs the suite: a probe is affected exactly where its
workaround is switched on, fails there without it with the documented error, and passes with it; where the gate is
off (the SAC rows on torch 2.12) the probe passes without the workaround ("not needed"). On torch 2.13, 2.14 and 2.15
every probe is affected. A torch release that fixes a failure turns its row "not needed" while its gate is still on,
and this test fails until the gate gets its ``until``. (The table output and the exit code with nemo_ac's gates
forced off: tests/unit/doctor/test_doctor_cli.py.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from nemo_ac.doctor.args import PROBE_NAMES
from nemo_ac.doctor.checks import CHECKS
from nemo_ac.doctor.runner import PROBES
from tests.launch import ROOT, child_env

pytestmark = [pytest.mark.workaround, pytest.mark.functional]

# What each probe's run without the workaround must fail with (the documented torch errors; searched as patterns).
DOCUMENTED = {
    "upstream_profiler_ignore": "profiler._record_function_enter_new.default",
    "sac_profiler_ops": "profiler._record_function_enter_new.default invocation index",
    "sac_fsdp_prefetch": "fsdp.all_gather_copy_in.default encountered during backward but not found in storage",
    "thread_config": "saw recompile_limit=8, capture_scalar_outputs=False",
    "recompute_thread": "Recomputed values for the following tensors have different metadata",
    "sac_compiled_regions": "Tensor cached during selective activation checkpoint has been mutated",
    "dynamic_ints": r"Dynamo compiled \d+ graphs for 3 micro batches",
    "grouped_mm_fake": "Expected (inputs of BF16 type|mat_a to be BFloat16)",  # 2.12 / 2.13 wording, then 2.14's
    "softplus_layout": "view size is not compatible with input tensor's size and stride",
    "rendezvous_restart": "handed the killed attempt's store",
}


def _doctor(*args: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_ac.cli", "doctor", *args],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.perf_counter() - start


@pytest.fixture(scope="module")
def doctor() -> dict:
    proc, wall = _doctor("--json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(proc.stdout)
    report["command_wall_s"] = wall
    print(f"\nnemo-ac doctor --json: {wall:.1f} s wall (probes {report['seconds']} s)")
    return report


def test_every_probe_ran_on_this_torch_and_the_report_is_ok(doctor):
    assert [p["name"] for p in doctor["probes"]] == list(PROBE_NAMES)
    assert doctor["ok"] is True and doctor["torch"] == torch.__version__


def test_every_private_torch_technique_was_checked_and_holds(doctor):
    """The full command also checks each technique row of the registry (doctor.checks) on this torch."""
    assert [check["row"] for check in doctor["checks"]] == [spec.row for spec in CHECKS]
    assert all(check["ok"] for check in doctor["checks"]), doctor["checks"]


@pytest.mark.parametrize("spec", PROBES, ids=lambda spec: spec.name)
def test_affected_exactly_where_the_gate_is_on_and_fixed_there(doctor, spec):
    probe = next(p for p in doctor["probes"] if p["name"] == spec.name)
    off, on = probe["off"], probe["on"]
    gate_on = spec.gate(None)
    assert probe["workaround_active"] is gate_on, probe
    assert probe["affected"] is gate_on, (
        f"{spec.name}: the doctor says affected={probe['affected']} on torch {torch.__version__} but the gate of "
        f"{spec.fix!r} is {'on' if gate_on else 'off'}: re-check nemo_ac/workarounds/gates.py",
        probe,
    )
    if gate_on:
        assert probe["status"] == "pass", probe
        assert not off["ok"] and off["signature"] and re.search(DOCUMENTED[spec.name], off["error"]), off
    else:
        assert probe["status"] == "not needed" and off["ok"], probe
    assert on["ok"] and not on["error"], on


def test_probes_with_workaround_reproduce_no_ac_gradients(doctor):
    facts = {p["name"]: p["on"]["facts"] for p in doctor["probes"]}
    assert facts["sac_profiler_ops"]["grads_match_no_ac"] is True
    assert facts["sac_fsdp_prefetch"]["grads_match_no_ac"] is True
    assert facts["sac_fsdp_prefetch"]["ranks"] == 2 and facts["sac_fsdp_prefetch"]["world_size"] == 2
    prefetch = next(spec for spec in PROBES if spec.name == "sac_fsdp_prefetch")
    expected_units = 7 if prefetch.gate(None) else 0  # 3 nested units + 3 blocks + the root, where the gate is on
    assert facts["sac_fsdp_prefetch"].get("protected_units") == expected_units
    assert facts["recompute_thread"]["max_grad_error_vs_eager"] <= 1e-4
    assert facts["sac_compiled_regions"]["grads_match_no_ac"] is True
    assert facts["softplus_layout"]["grads_match_eager_softplus"] is True
    assert facts["dynamic_ints"]["graphs"] == 1
