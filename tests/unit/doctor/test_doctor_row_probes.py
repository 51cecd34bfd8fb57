"""The doctor's compile-free probes of five failure rows, each run here with its workaround forced off and on.

On torch 2.13 every one is affected: off must fail with its documented error (the verdict's ``signature``), on must
pass. A workaround taken away from the "on" run (as a torch release or a refactor could) must turn the verdict
into FAIL, so each probe can tell a broken workaround from a working one.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

from nemo_ac.config.schema import CompileConfig
from nemo_ac.doctor import probes_compile, probes_kernels, probes_launch, probes_regions
from nemo_ac.doctor.probes_compile import run_dynamic_ints_probe, run_softplus_layout_probe
from nemo_ac.doctor.probes_kernels import run_grouped_mm_fake_probe
from nemo_ac.doctor.probes_launch import run_rendezvous_probe
from nemo_ac.doctor.probes_regions import run_compiled_regions_probe
from nemo_ac.doctor.result import judge
from nemo_ac.doctor.runner import PROBES
from nemo_ac.workarounds.gates import torch_version_release

pytestmark = [
    pytest.mark.workaround,
    pytest.mark.skipif(torch_version_release() < (2, 13), reason="the verdicts below are torch 2.13's"),
]

# probe -> (run function, what its off run fails with: a pattern)
AFFECTED = {
    "sac_compiled_regions": (run_compiled_regions_probe, "Tensor cached during selective activation checkpoint"),
    "dynamic_ints": (run_dynamic_ints_probe, r"Dynamo compiled \d+ graphs for 3 micro batches"),
    "grouped_mm_fake": (run_grouped_mm_fake_probe, "Expected (inputs of BF16 type|mat_a to be BFloat16)"),
    "softplus_layout": (run_softplus_layout_probe, "view size is not compatible with input tensor's size and stride"),
    "rendezvous_restart": (run_rendezvous_probe, "handed the killed attempt's store"),
}


def test_these_are_the_runner_probes_of_their_rows():
    targets = {spec.name: spec.target.rsplit(".", 1)[1] for spec in PROBES}
    assert {name: targets[name] for name in AFFECTED} == {name: fn.__name__ for name, (fn, _) in AFFECTED.items()}


@pytest.mark.parametrize("name", AFFECTED)
def test_affected_without_the_workaround_and_passing_with_it(world, name):
    run, documented = AFFECTED[name]
    off = run(workaround=False)
    assert not off.ok and off.signature and re.search(documented, off.error), off
    on = run(workaround=True)
    assert on.ok and not on.error, on
    assert judge(name=name, title="t", workaround="w", workaround_active=True, off=off, on=on).status == "pass"


def test_facts_say_what_was_seen(world):
    assert run_compiled_regions_probe(workaround=True).facts == {
        "torch_wraps_by_default": False,
        "grads_match_no_ac": True,
    }
    assert run_dynamic_ints_probe(workaround=True).facts == {"graphs": 1, "batches": 3, "declared": True}
    assert run_grouped_mm_fake_probe(workaround=False).facts["aten_fake_rule"]["float32"] == "rejects"
    environ = dict(os.environ)
    assert run_rendezvous_probe(workaround=False).facts == {
        "use_agent_store": True,
        "same_store_after_restart": True,
        "train_py_warns": True,
    }
    assert run_rendezvous_probe(workaround=True).facts["use_agent_store"] is False
    assert dict(os.environ) == environ, "the rendezvous probe leaked an environment variable"


def _fail_verdict(name: str) -> str:
    run, _ = AFFECTED[name]
    off, on = run(workaround=False), run(workaround=True)
    return judge(name=name, title="t", workaround="w", workaround_active=True, off=off, on=on).status


def test_a_region_that_is_not_wrapped_fails_with_the_workaround(world, monkeypatch):
    """nemo_ac's modes alone do not help if inductor no longer wraps its code (the option gone or ignored)."""
    monkeypatch.setattr(probes_regions, "run_as_compiled_region", lambda code, inputs: code(inputs))
    assert _fail_verdict("sac_compiled_regions") == "FAIL"


def test_ints_left_undeclared_fail_with_the_workaround(monkeypatch):
    """As if the compile settings stopped declaring them (``compile.dynamic_ints`` ignored): Dynamo recompiles."""
    monkeypatch.setattr(probes_compile, "CompileConfig", lambda **kw: CompileConfig(**{**kw, "dynamic_ints": False}))
    assert _fail_verdict("dynamic_ints") == "FAIL"


def test_torch_softplus_in_place_of_the_workaround_fails(monkeypatch):
    monkeypatch.setattr(probes_compile, "softplus", F.softplus)
    assert _fail_verdict("softplus_layout") == "FAIL"


def test_a_launcher_that_keeps_the_shared_store_fails(monkeypatch):
    """As if ``nemo-ac train --max-restarts`` stopped exporting the variable (or torch stopped reading it)."""
    monkeypatch.setattr(probes_launch, "FRESH_STORE_ENV", {"NEMO_AC_DOCTOR_UNREAD": "1"})
    assert _fail_verdict("rendezvous_restart") == "FAIL"


def test_the_aten_op_in_place_of_the_custom_op_fails(monkeypatch):
    """As if the experts called ``torch._grouped_mm`` directly in fp32: the fake rule rejects it."""
    monkeypatch.setattr(probes_kernels, "traceable_grouped_mm", lambda x, w, offs: torch._grouped_mm(x, w, offs=offs))
    assert _fail_verdict("grouped_mm_fake") == "FAIL"
