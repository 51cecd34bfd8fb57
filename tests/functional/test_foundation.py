"""The spine: the tiny recipe trains on real multi-process FSDP2 (gloo) and matches a single process."""

from __future__ import annotations

import pytest

from tests.launch import assert_close_rel, run_recipe
from tests.parity import TOLERANCES

pytestmark = pytest.mark.functional

RECIPE = "tiny/qwen3_moe_tiny.yaml"


def test_world_size_1_and_2_give_the_same_losses_and_the_loss_falls(tmp_path):
    """FSDP2 over 2 gloo ranks equals one process (fp32, the parity table's tolerance) step for step, incl. grad
    accumulation, through the torchrun entry itself (losses and grad norms from metrics.jsonl; every parameter's
    gradient is compared in tests/functional/test_parity.py).

    micro_batch_size * dp is the same in both runs, so every micro step sees the same global rows.
    """
    common = ["train.steps=8", "train.global_batch_size=8", "activation_checkpointing.mode=full"]
    single = run_recipe(RECIPE, nproc=1, run_dir=tmp_path / "ws1", overrides=[*common, "train.micro_batch_size=4"])
    double = run_recipe(RECIPE, nproc=2, run_dir=tmp_path / "ws2", overrides=[*common, "train.micro_batch_size=2"])
    single.check()
    double.check()
    assert len(single.losses) == 8
    rel = TOLERANCES["float32"].loss
    assert_close_rel(double.losses, single.losses, rel=rel)
    assert_close_rel([m["grad_norm"] for m in double.metrics], [m["grad_norm"] for m in single.metrics], rel=rel)
    assert double.losses[-1] < double.losses[0] - 0.2, double.losses
    assert "summary |" in double.output and "first_loss" in double.summary


def test_bad_recipe_fails_before_any_process_group(tmp_path):
    result = run_recipe(RECIPE, nproc=2, run_dir=tmp_path / "bad", overrides=["model.num_layer=3"])
    assert result.returncode != 0
    assert "model.num_layer: unknown key. Did you mean 'model.num_layers'?" in result.output
    assert "init_process_group" not in result.output
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
