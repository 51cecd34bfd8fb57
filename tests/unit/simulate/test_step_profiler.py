"""``nemo_ac.simulate.measure --profile``: the extra step's table is torch profiler's own, printed and written, and its
per-op summary is what ``nemo-ac plan --against`` holds the estimate's ops against."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_ac.simulate.accuracy import profile_lines
from nemo_ac.simulate.estimate import StepEstimate
from nemo_ac.simulate.measure import step_profiler


def test_the_profiled_step_writes_and_prints_torchs_op_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = torch.randn(64, 64)
    with step_profiler(enabled=True, device_type="cpu", out=tmp_path, rank=0) as summary:
        torch.mm(a, a).relu_()
    assert summary["device_type"] == "cpu" and summary["device_busy_s"] == 0.0  # no kernels on a device
    assert summary["ops"]["aten::mm"]["calls"] == 1 and summary["ops"]["aten::mm"]["self_cpu_s"] > 0
    assert summary["host_s"] >= summary["ops"]["aten::mm"]["self_cpu_s"]
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


def _estimate(**by_op: float) -> StepEstimate:
    return StepEstimate(gpu="h200-141gb", compute_s=sum(by_op.values()), compute_eager_s=1.0, compute_fused_s=0.1,
                        by_op=dict(by_op))  # fmt: skip


def _op(device_ms: float, calls: int = 1) -> dict[str, float]:
    return {"calls": calls, "self_device_s": device_ms / 1e3, "self_cpu_s": 0.001}


def test_against_a_profiled_gpu_step_names_the_bound_and_sets_each_op_beside_its_estimate() -> None:
    profile = {
        "device_type": "cuda",
        "wall_s": 1.0,
        "device_busy_s": 0.3,
        "host_s": 0.9,
        "ops": {"aten::mm": _op(100.0, 4), "aten::copy_": _op(150.0, 9), "Torch-Compiled Region: 0/0": _op(50.0)},
    }
    lines = profile_lines(profile, _estimate(mm=0.08, copy_=0.02), rows=2)
    assert "host-bound: kernels ran 30% of it" in lines[0] and "0.100 s is -66.7% against" in lines[0]
    assert "aten::copy_" in lines[1] and "150.00 ms (9 calls)" in lines[1] and "estimated     20.00 ms" in lines[1]
    assert "aten::mm" in lines[2] and "estimated     80.00 ms" in lines[2] and len(lines) == 3
    busy = {**profile, "device_busy_s": 0.9}
    assert "host-bound" not in profile_lines(busy, _estimate(mm=0.08), rows=3)[0]
    assert "estimated         -" in profile_lines(busy, _estimate(mm=0.08), rows=3)[3]  # the compiled region
    assert profile_lines({**profile, "device_type": "cpu"}, _estimate(mm=0.08)) == []  # no kernel time to hold
    assert profile_lines({}, _estimate(mm=0.08)) == []  # measured without --profile
