"""The doctor's checks of the private torch techniques nemo_ac relies on (``nemo_ac.doctor.checks``): each passes on
the installed torch, and a technique whose private API is gone makes the report say BROKEN and exit 1."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from nemo_ac.doctor.checks import CHECKS, run_check, run_checks
from nemo_ac.doctor.report import DoctorReport, render_table
from nemo_ac.workarounds import dynamo_compile_events, dynamo_disable_marker, node_shared_compile

pytestmark = pytest.mark.workaround


@pytest.fixture(autouse=True)
def torch_state_untouched():
    real = torch_checkpoint.SAC_IGNORED_OPS
    before = set(real)
    yield
    assert torch_checkpoint.SAC_IGNORED_OPS is real and real == before


@pytest.mark.parametrize("spec", CHECKS, ids=lambda spec: spec.row)
def test_each_technique_holds_on_this_torch(world, spec):
    result = run_check(spec)
    assert result.ok, result.error + "\n" + result.facts.get("traceback", "")
    assert result.facts


def test_autograd_inside_op_is_needed_and_works():
    """Without the lift, autograd inside a custom op's body records nothing (torch 2.13); with it, the gradient."""
    result = run_check(next(spec for spec in CHECKS if spec.row == "autograd_inside_op"))
    assert result.ok and "does not require grad" in result.facts["without"]


@pytest.mark.parametrize(
    ("row", "module", "name", "replacement"),
    [
        ("dynamo_compile_events", dynamo_compile_events, "compile_callback_handler", lambda: None),
        ("dynamo_disable_marker", dynamo_disable_marker, "_MARKER", "_no_such_marker"),
        ("node_shared_compile", node_shared_compile, "available", lambda: False),
    ],
)
def test_a_missing_private_api_is_broken_in_the_report(monkeypatch, row, module, name, replacement):
    """As if a torch release had moved the API: the check fails, the report is not ok and the table says so."""
    monkeypatch.setattr(module, name, replacement)
    result = run_check(next(spec for spec in CHECKS if spec.row == row))
    assert not result.ok and result.error.startswith("AssertionError")
    report = DoctorReport(torch_version=torch.__version__, assumed_torch_version=None, device="cpu", checks=[result])
    assert report.exit_code == 1 and report.to_dict()["checks"][0]["ok"] is False
    assert f"| {row} | BROKEN: AssertionError" in render_table(report) and "PROBLEM" in render_table(report)


def test_all_checks_in_one_report_are_ok(world):
    report = DoctorReport(torch_version=torch.__version__, assumed_torch_version=None, device="cpu")
    report.checks = run_checks()
    assert report.ok and [check["row"] for check in report.to_dict()["checks"]] == [spec.row for spec in CHECKS]
    assert "| private torch nemo_ac relies on | workarounds module | state | time (s) |" in render_table(report)


def test_compile_events_check_holds_once_the_metrics_deque_is_full(monkeypatch):
    """Dynamo keeps at most 64 compile records: in a process that compiled that many (a long test session, a trainer
    before ``nemo-ac doctor``'s in-process checks) the deque's length no longer grows, and a check counting its length
    reported ``metrics: 0`` as a broken technique."""
    import collections

    from torch._dynamo import utils as dynamo_utils

    real = dynamo_utils._compilation_metrics
    full = collections.deque((object() for _ in range(real.maxlen or 64)), maxlen=real.maxlen or 64)
    monkeypatch.setattr(dynamo_utils, "_compilation_metrics", full)
    torch._dynamo.reset()
    result = run_check(next(spec for spec in CHECKS if spec.row == "dynamo_compile_events"))
    assert result.ok, result.error
    assert result.facts["metrics"] >= 1
