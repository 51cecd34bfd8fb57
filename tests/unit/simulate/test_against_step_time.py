"""``nemo-ac plan --against``'s step-time line: the estimate's error only against a step measured on the GPU the
estimate is for (an H100 estimate against a CPU step read "error -100%")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nemo_ac.simulate.accuracy import step_time_line
from nemo_ac.simulate.gpus import spec_for_device_name

ESTIMATE = SimpleNamespace(gpu="h100-80gb", step_s=1.1, step_fused_s=0.9, step_eager_s=1.5)


@pytest.mark.parametrize(
    ("device_name", "spec"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H200", "h200-141gb"),
        ("NVIDIA B200", "b200-180gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA H100 NVL", None),  # another H100: other clocks, memory and links than the SXM spec
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA A100-SXM4-40GB", None),
        ("NVIDIA L4", None),
    ],
)
def test_a_device_name_maps_to_the_spec_it_is_or_none(device_name: str, spec: str | None) -> None:
    found = spec_for_device_name(device_name)
    assert (found.name if found is not None else None) == spec


def test_the_error_is_printed_only_against_a_step_on_the_estimated_gpu() -> None:
    on_h100 = {"step_wall_s": [1.2, 1.0, 1.1], "device": "cuda:0", "gpu_name": "NVIDIA H100 80GB HBM3"}
    line = step_time_line(on_h100, ESTIMATE)
    assert line is not None and line.endswith("error +0.0%") and "median of 3" in line
    on_h200 = {**on_h100, "gpu_name": "NVIDIA H200"}
    assert "no error printed: measured on NVIDIA H200, estimated for h100-80gb" in step_time_line(on_h200, ESTIMATE)
    on_cpu = {"step_wall_s": [0.4], "device": "cpu", "gpu_name": None}
    line = step_time_line(on_cpu, ESTIMATE)
    assert "no error printed: measured on cpu, estimated for h100-80gb" in line and "error -" not in line
    assert step_time_line({"step_wall_s": [], "device": "cpu"}, ESTIMATE) is None
