"""What a user sees on real launches: a recipe typo is reported once (rank 0), and `nemo-ac train` shows it in at
most 5 lines; plain torchrun adds its own ChildFailedError report, which only the `nemo-ac train` path avoids."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.launch import RECIPES, ROOT, child_env, torchrun_command

pytestmark = pytest.mark.functional

RECIPE = str(RECIPES / "tiny/qwen3_moe_tiny.yaml")
TYPO = "train.stepz=3"
REPORT = "train.stepz: unknown key. Did you mean 'train.steps'?"


def test_a_typo_under_torchrun_is_printed_once_by_rank_0():
    proc = subprocess.run(
        torchrun_command(2, ["-m", "nemo_ac.train", RECIPE, TYPO]),
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count(REPORT) == 1, output  # rank 1 found it too, and stayed quiet
    assert output.count("nemo_ac: invalid recipe") == 1
    ours = [line for line in output.splitlines() if "nemo_ac" in line and "torch/distributed" not in line]
    assert "exitcode  : 2" in output  # torchrun's report names rank 0's exit code 2 as the root cause
    assert len(ours) <= 4, output


def test_a_typo_through_nemo_ac_train_is_at_most_5_lines_and_never_reaches_torchrun():
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_ac.cli", "train", RECIPE, "--nproc-per-node", "2", TYPO],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    print("\n".join(lines))
    assert proc.returncode == 2
    assert len(lines) <= 5 and any(REPORT in line for line in lines), lines
    assert not any("torch.distributed" in line or "Traceback" in line for line in lines)
