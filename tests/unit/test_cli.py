"""The nemo-ac console script: validate checks a recipe for a world size without starting anything."""

from __future__ import annotations

from pathlib import Path

from nemo_ac.cli import main

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = str(RECIPES / "tiny" / "qwen3_moe_tiny.yaml")


def test_validate_ok(capsys):
    assert main(["validate", TINY, "--world-size", "2"]) == 0
    assert "OK at world size 2: dp_replicate 1 x dp_shard 2 x cp 1" in capsys.readouterr().out


def test_validate_plan_prints_the_plan_of_the_flagship_without_a_gpu(capsys):
    """The Nemotron recipe at 64 ranks: every TE block is AC(compile(block)), with its graph breaks named."""
    assert main(["validate", str(RECIPES / "nemotron_super_v3_te_deepep.yaml"), "--world-size", "64", "--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("plan | ep 64 (deepep)") and "backend.linear te | backend.rms_norm te" in lines[1]
    blocks = [line for line in lines if "model.layers." in line]
    assert len(blocks) == 3 and all("compile ac_outer (graph breaks at te.Linear x" in line for line in blocks)
    assert sum(int(line.split(") |")[0].rsplit("(", 1)[1]) for line in blocks) == 88


def test_validate_with_overrides_reports_every_problem(capsys):
    assert main(["validate", TINY, "train.stepz=3", "--world-size", "4"]) == 2
    assert "train.stepz: unknown key. Did you mean 'train.steps'?" in capsys.readouterr().err
    assert main(["validate", TINY, "--world-size", "4", "parallel.cp=3", "model.moe.num_experts=6"]) == 2
    err = capsys.readouterr().err
    assert "parallel.dp_shard: world size 4 is not divisible by dp_replicate*cp = 1*3" in err
    assert "parallel.cp: ulysses CP splits attention heads: num_attention_heads=4 must be divisible by cp=3" in err


def test_train_validates_before_launching(capsys):
    assert main(["train", TINY, "--nproc-per-node", "3", "train.global_batch_size=8"]) == 2
    assert "train.global_batch_size: 8 must be divisible by dp*micro_batch_size = 3*2" in capsys.readouterr().err
