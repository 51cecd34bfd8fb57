"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from nemo_ac.doctor import isolation


@pytest.fixture(scope="module")
def world() -> Iterator[dist.ProcessGroup]:
    """A real gloo process group of world size 1 in this process (an in-memory store), for FSDP2 and DCP.

    Module scoped: one group per test module, torn down before the next module makes its own."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches and counters reset before and after the test (compile counts are asserted per test)."""
    with isolation.fresh_dynamo():
        yield
