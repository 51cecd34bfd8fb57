"""``nemo_ac.simulate.measure --profile``: the extra step's table is torch profiler's own, printed and written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_ac.simulate.measure import step_profiler


def test_the_profiled_step_writes_and_prints_torchs_op_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = torch.randn(64, 64)
    with step_profiler(enabled=True, device_type="cpu", out=tmp_path, rank=0):
        torch.mm(a, a).relu_()
    table = (tmp_path / "profile_rank0.txt").read_text()
    assert "aten::mm" in table and "aten::relu_" in table and "Self CPU" in table
    printed = capsys.readouterr().out.splitlines()
    assert printed and all(line.startswith("profile | ") for line in printed)
    assert any("aten::mm" in line for line in printed)


def test_without_profile_nothing_is_recorded_and_other_ranks_only_write(tmp_path: Path, capsys) -> None:
    with step_profiler(enabled=False, device_type="cpu", out=tmp_path, rank=0):
        torch.ones(2).sum()
    assert not (tmp_path / "profile_rank0.txt").exists()
    with step_profiler(enabled=True, device_type="cpu", out=tmp_path, rank=1):
        torch.ones(2).sum()
    assert "aten::sum" in (tmp_path / "profile_rank1.txt").read_text()
    assert capsys.readouterr().out == ""
