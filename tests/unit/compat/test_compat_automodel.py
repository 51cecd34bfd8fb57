"""NeMo Automodel interop: an Automodel-built selective AC region, put through the doctor's recompute-thread probe,
and a few training steps through Automodel's own SAC context factory with nemo_ac's compat installed.

Automodel's own ``make_selective_checkpoint_context_fn()`` factory fails the probe (its recompute on another thread
compiles with that thread's Dynamo defaults); wrapped by ``nemo_ac.compat.automodel.automodel_selective_context_fn``
it passes with eager gradients. The training (tests/functional/workers/automodel_training.py) shows the same over
optimizer steps, and that Automodel's factory trains FSDP2 nested units with ``compat.install()`` in force. Both run
in a subprocess: importing Automodel's distributed package applies its own patches and its factory adds ops to
torch's SAC_IGNORED_OPS, none of which may leak into this test process. CI installs the ``automodel`` extra
(``make test EXTRAS=dev,automodel``), so these run there; without it they skip.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nemo_ac.compat import automodel
from tests.launch import ROOT, child_env

needs_automodel = pytest.mark.skipif(
    not automodel.automodel_available(),
    reason="nemo-automodel is not installed (optional extra: pip install 'nemo_ac[automodel]')",
)

SCRIPT = """
import json
from nemo_ac.compat.automodel import automodel_ac_module, automodel_selective_context_fn
from nemo_ac.doctor.probes_thread import run_recompute_thread_probe

factory = automodel_ac_module().make_selective_checkpoint_context_fn()
plain = run_recompute_thread_probe(workaround=False, sac_context_fn=factory)
wrapped = run_recompute_thread_probe(workaround=False, sac_context_fn=automodel_selective_context_fn(factory))
print(json.dumps({"plain": plain.to_dict(), "wrapped": wrapped.to_dict()}))
"""


@needs_automodel
def test_automodel_sac_region_survives_the_thread_probe_only_when_wrapped():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, wrapped = runs["plain"], runs["wrapped"]
    assert not plain["ok"] and plain["signature"] and plain["error_type"] == "CheckpointError", plain
    assert wrapped["ok"], wrapped
    assert wrapped["facts"]["max_grad_error_vs_eager"] <= 1e-4


@needs_automodel
def test_training_through_automodels_sac_factory_with_nemo_ac_installed():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.functional.workers.automodel_training"],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["install"] in ("added", "upstream"), runs["install"]
    for name in ("fsdp_none", "fsdp_automodel", "compiled_none", "compiled_nemo_ac"):
        assert runs[name]["error"] is None, (name, runs[name])
    reference = runs["fsdp_none"]["losses"]
    assert len(reference) == 3 and reference[-1] < reference[0]  # it trains
    # SAC changes what is stored, not what is computed: every run takes the same steps as the one without AC.
    for name in ("fsdp_automodel", "compiled_none", "compiled_nemo_ac"):
        assert runs[name]["losses"] == pytest.approx(reference, rel=1e-6, abs=1e-7), (name, runs[name]["losses"])
    # Automodel's factory alone: the recompute on the other thread compiles with that thread's Dynamo defaults.
    plain = runs["compiled_automodel"]
    assert plain["losses"] is None and plain["error"].startswith("CheckpointError"), plain
    assert "Recomputed values for the following tensors have different metadata" in plain["error"]


def test_missing_automodel_fails_with_the_install_line(monkeypatch):
    """Whether or not Automodel is installed: a module that cannot be imported names the extra to install."""
    monkeypatch.setattr(automodel, "AUTOMODEL_AC_MODULE", "nemo_automodel_not_here.activation_checkpointing")
    with pytest.raises(ImportError, match=r"pip install 'nemo_ac\[automodel\]'"):
        automodel.automodel_selective_context_fn()
