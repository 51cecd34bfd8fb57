"""Routing replay with real expert parallel: when the router would choose differently in the recompute, the old
behaviour dies with a CheckpointError (the all-to-all split sizes change); with the replay every parameter's
gradient equals the run without activation checkpointing (one 2-rank gloo launch, EP2, full AC)."""

from __future__ import annotations

import json

import pytest

from tests.launch import ROOT, run_script

pytestmark = pytest.mark.functional
WORKER = ROOT / "tests" / "functional" / "workers" / "routing_replay.py"


def test_full_ac_with_ep_reuses_the_forward_routing(tmp_path):
    out = tmp_path / "out.json"
    overrides = ["parallel.ep=2", "train.steps=1", "train.warmup_steps=0", "dist.timeout_s=60"]
    proc = run_script(WORKER, nproc=2, args=[str(out), *overrides], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    assert result["replay"]["parameters"] > 10
    assert result["replay"]["max_grad_diff"] == 0.0 and result["replay"]["loss_diff"] == 0.0
    assert "CheckpointError" in result["no_replay"].get("error", ""), result["no_replay"]
