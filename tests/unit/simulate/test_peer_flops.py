"""Model FLOPs by NeMo Automodel's own formula (``simulate.peer_flops``): a plan's TFLOP/s beside Automodel's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_ac.cli import main as cli
from nemo_ac.config import load_recipe
from nemo_ac.simulate import peer_flops
from nemo_ac.simulate.peer_flops import automodel_available, automodel_flops
from tests.factories import REPO_ROOT as ROOT
from tests.factories import TINY_PLAN_RECIPE as TINY

needs_automodel = pytest.mark.skipif(not automodel_available(), reason="optional extra nemo_ac[automodel]")


@needs_automodel
def test_automodels_formula_turns_its_published_tokens_per_second_into_its_published_tflops() -> None:
    """Automodel's Qwen3-30B-A3B row: 12,040 tokens/s per GPU and 277 TFLOP/s per GPU by its formula, at 4,096-token
    rows. The formula, picked from the recipe's model as a transformers config, gives that ratio."""
    peer = automodel_flops(load_recipe(ROOT / "benchmarks/recipes/qwen3_30b_a3b_automodel_ep8.yaml"))
    assert peer is not None and peer.formula == "qwen3_flops" and peer.row_tokens == 4096
    assert peer.flops_per_token * 12_040 / 1e12 == pytest.approx(277, rel=0.005)


@needs_automodel
def test_the_plan_prints_and_writes_automodels_tflops_per_gpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    assert cli(["plan", TINY, "--world-size", "2", "--gpu", "h100-80gb", "--json", str(out)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "by NeMo Automodel's" in line)
    assert "qwen3_flops" in line and "TFLOP/s per GPU" in line
    report = json.loads(out.read_text())
    assert report["automodel_flops"]["formula"] == "qwen3_flops"
    estimate = report["estimates"][0]
    expected = report["automodel_flops"]["flops_per_token"] * estimate["tokens_per_s_per_gpu"] / 1e12
    assert estimate["automodel_tflops_per_gpu"] == pytest.approx(expected)


def test_without_automodel_the_plan_has_no_such_line(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr(peer_flops, "automodel_available", lambda: False)
    out = tmp_path / "plan.json"
    assert cli(["plan", TINY, "--world-size", "2", "--gpu", "h100-80gb", "--json", str(out)]) == 0
    assert "Automodel" not in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["automodel_flops"] is None and report["estimates"][0]["automodel_tflops_per_gpu"] is None
