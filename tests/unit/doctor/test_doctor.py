"""The doctor's probes, each run in this process with its workaround forced off and on, and how runs become
verdicts and an exit code. The two expensive probes (2 processes; inductor-free compiles on two threads) are run
forced off and on by the whole ``nemo-ac doctor`` command, once per session, in tests/functional/test_doctor.py,
and the recompute-thread probe again by tests/unit/compat/test_compat_automodel.py with Automodel's SAC factory.

On torch 2.13 every probe is affected: off must fail with the documented error, on must pass with the gradients of
the same model without activation checkpointing. Forcing nemo_ac's gate off (``torch_version="2.12.0"``) must turn
an affected probe into FAIL and the exit code into 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from nemo_ac.doctor.args import PROBE_NAMES
from nemo_ac.doctor.probes_sac import PROFILER_DESYNC, run_profiler_ops_probe
from nemo_ac.doctor.probes_thread import run_thread_config_probe
from nemo_ac.doctor.probes_upstream import run_upstream_profiler_check
from nemo_ac.doctor.report import DoctorReport, render_table
from nemo_ac.doctor.result import ProbeRun, judge
from nemo_ac.doctor.runner import PROBES
from nemo_ac.workarounds.gates import torch_version_release

pytestmark = [
    pytest.mark.workaround,
    pytest.mark.skipif(
        torch_version_release() < (2, 13), reason="the verdicts below are torch 2.13's (nemo_ac's pinned torch)"
    ),
]


@pytest.fixture(autouse=True)
def torch_state_untouched():
    """Probes swap in private copies and reset Dynamo; nothing may leak into torch's globals."""
    real = torch_checkpoint.SAC_IGNORED_OPS
    before = set(real)
    dynamo = torch._dynamo.config.recompile_limit, torch._dynamo.config.capture_scalar_outputs
    yield
    assert torch_checkpoint.SAC_IGNORED_OPS is real and real == before
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.capture_scalar_outputs) == dynamo


def test_probe_names_match_the_cli_choices():
    assert tuple(spec.name for spec in PROBES) == PROBE_NAMES


def test_profiler_ops_probe_forced_off_and_on(world):
    off = run_profiler_ops_probe(workaround=False)
    assert not off.ok and off.signature and off.error_type == "RuntimeError"
    assert PROFILER_DESYNC.search(off.error) and "not found in storage" in off.error
    on = run_profiler_ops_probe(workaround=True)
    assert on.ok and on.facts == {"profiler_ops": "added", "grads_match_no_ac": True}


def test_profiler_ops_probe_with_the_gate_off_fails_and_the_doctor_exits_1(world):
    """As if torch were 2.12: install() applies nothing, the probe still fails with the workaround 'on'."""
    off = run_profiler_ops_probe(workaround=False)
    on = run_profiler_ops_probe(workaround=True, torch_version="2.12.0")
    assert not on.ok and on.signature and on.facts["profiler_ops"] == "not_needed"
    verdict = judge(
        name="sac_profiler_ops", title="t", workaround="compat.install()", workaround_active=False, off=off, on=on
    )
    assert (verdict.affected, verdict.status, verdict.failed) == (True, "FAIL", True)
    report = DoctorReport(torch_version=torch.__version__, assumed_torch_version="2.12.0", device="cpu")
    report.verdicts.append(verdict)
    assert report.exit_code == 1
    table = render_table(report)
    assert "| yes | compat.install() | no | FAIL |" in table and "WITH the workaround: RuntimeError: profiler." in table


def test_upstream_profiler_check_forced_off_and_on():
    off = run_upstream_profiler_check(workaround=False)
    assert not off.ok and off.signature and "profiler._record_function_enter_new.default" in off.error
    on = run_upstream_profiler_check(workaround=True)
    assert on.ok and on.facts["install"] == "added"


def test_thread_config_probe_forced_off_and_on():
    off = run_thread_config_probe(workaround=False)
    assert not off.ok and off.signature
    assert "recompile_limit=8, capture_scalar_outputs=False, dynamic_sources=''" in off.error
    assert off.facts["recompute_thread"] != off.facts["forward_thread"]
    on = run_thread_config_probe(workaround=True)
    assert on.ok, on.error


def _run(ok: bool, *, signature: bool = False) -> ProbeRun:
    return ProbeRun(workaround=False, ok=ok, signature=signature, error=None if ok else "boom")


@pytest.mark.parametrize(
    ("off", "on", "affected", "status"),
    [
        (_run(False, signature=True), _run(True), True, "pass"),
        (_run(True), _run(True), False, "not needed"),
        (_run(False, signature=True), _run(False, signature=True), True, "FAIL"),
        (_run(False, signature=False), _run(True), None, "error"),
        (_run(False, signature=True), _run(False, signature=False), True, "error"),
    ],
    ids=["fixed", "upstream_fixed", "still_failing", "unexpected_off_error", "unexpected_on_error"],
)
def test_judge(off, on, affected, status):
    """The decision table: an unexpected error is never read as 'affected' or 'fixed'."""
    verdict = judge(name="p", title="t", workaround="w", workaround_active=True, off=off, on=on)
    assert (verdict.affected, verdict.status) == (affected, status)
    assert verdict.failed is (status in ("FAIL", "error"))
