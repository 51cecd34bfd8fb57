"""The nemo-ac console script: validate checks a recipe for a world size without starting anything."""

from __future__ import annotations

from pathlib import Path

from nemo_ac.cli import main

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "qwen3_moe_tiny.yaml")


def test_validate_ok(capsys):
    assert main(["validate", TINY, "--world-size", "2"]) == 0
    assert "OK at world size 2: dp_replicate 1 x dp_shard 2 x cp 1" in capsys.readouterr().out


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
