"""Fixtures shared by the tests (pytest finds them here without an import)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.utils import checkpoint as torch_checkpoint

from nemo_ac.config.corpus_key import ENV_CACHE_DIR
from nemo_ac.doctor import isolation

# No test may reach the Hugging Face Hub (CI has no network; a Hub id must resolve from a snapshot, the cache or fail
# fast). Set before huggingface_hub is imported, which reads it once; torchrun workers inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tokenized text corpora (nemo_ac/data/corpus.py) go to a directory of this test session, shared by its torchrun
# workers, never to the user's ~/.cache: every session starts without them, so the first use builds, the rest map.
_DATA_CACHE = tempfile.mkdtemp(prefix="nemo_ac_data_cache.")
os.environ[ENV_CACHE_DIR] = _DATA_CACHE
atexit.register(shutil.rmtree, _DATA_CACHE, ignore_errors=True)


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


@pytest.fixture
def private_sac_ignored_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[set]:
    """A copy of torch's SAC_IGNORED_OPS minus the profiler ops; the real set is checked untouched afterwards."""
    from nemo_ac.workarounds.profiler_ops_in_sac import profiler_op_overloads

    real = torch_checkpoint.SAC_IGNORED_OPS
    snapshot = set(real)
    private = set(real) - set(profiler_op_overloads())
    monkeypatch.setattr(torch_checkpoint, "SAC_IGNORED_OPS", private)
    yield private
    assert torch_checkpoint.SAC_IGNORED_OPS is private
    monkeypatch.undo()
    assert torch_checkpoint.SAC_IGNORED_OPS is real and real == snapshot, "the real SAC_IGNORED_OPS was changed"
