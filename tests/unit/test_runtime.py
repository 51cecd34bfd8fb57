"""Process-group start-up: which backend each device and optimizer policy gets."""

from __future__ import annotations

import pytest

from nemo_ac.config.schema import DistConfig
from nemo_ac.runtime import resolve_backend


@pytest.mark.parametrize(
    ("backend", "device_type", "host_collectives", "expected"),
    [
        ("auto", "cpu", False, "gloo"),
        ("auto", "cpu", True, "gloo"),
        ("auto", "cuda", False, "nccl"),
        # train.optimizer_offload: full reduces the gradient norm of host shards: gloo beside nccl for CPU tensors.
        ("auto", "cuda", True, "cuda:nccl,cpu:gloo"),
        ("nccl", "cuda", True, "cuda:nccl,cpu:gloo"),
        ("gloo", "cuda", True, "gloo"),
    ],
)
def test_the_backend_takes_host_tensors_where_the_run_reduces_them(
    backend: str, device_type: str, host_collectives: bool, expected: str
) -> None:
    cfg = DistConfig(backend=backend)
    assert resolve_backend(cfg, device_type, host_collectives=host_collectives) == expected
