"""What every doctor probe runs under: a private copy of torch's SAC ignore set, a fresh Dynamo, a worker thread.

The probes switch workarounds off and on inside one process, so none of them may leak into the next one or into
the caller: torch's ``SAC_IGNORED_OPS`` is swapped for a private copy for the duration of a probe (torch's SAC
modes read the module attribute per op) and Dynamo's caches are reset before and after.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

from nemo_ac.workarounds.dynamo_compile_events import clear_dynamo_counters
from nemo_ac.workarounds.profiler_ops_in_sac import profiler_op_overloads, profiler_ops_ignored_upstream

T = TypeVar("T")


@contextmanager
def private_sac_ignored_ops(*, upstream_only: bool) -> Iterator[set[Any]]:
    """Swap ``torch.utils.checkpoint.SAC_IGNORED_OPS`` for a private copy; the real set is never touched.

    upstream_only: drop the profiler ops from the copy unless torch itself ignored them before nemo_ac was imported
        (so "without the workaround" means torch as shipped, even in a process where nemo_ac already installed it).
    """
    real = getattr(torch_checkpoint, "SAC_IGNORED_OPS", None)
    private = set(real or ())
    if upstream_only and not profiler_ops_ignored_upstream():
        private.difference_update(profiler_op_overloads())
    if real is None:
        yield private
        return
    torch_checkpoint.SAC_IGNORED_OPS = private
    try:
        yield private
    finally:
        torch_checkpoint.SAC_IGNORED_OPS = real


@contextmanager
def fresh_dynamo() -> Iterator[None]:
    """Reset Dynamo's caches and counters before and after (a probe's compiles must not serve the next probe)."""
    torch.compiler.reset()
    clear_dynamo_counters()
    try:
        yield
    finally:
        torch.compiler.reset()
        clear_dynamo_counters()


def on_thread(fn: Callable[[], T], *, num_threads: int | None = None, name: str = "nemo_ac-doctor") -> T:
    """Run ``fn`` on a new thread and return its result or re-raise its exception.

    num_threads: the thread's intra-op thread count for the duration. It is part of Dynamo's global-state guard,
        so a compiled frame called there misses the cache entries made on this thread and compiles again, as the
        CUDA autograd device thread does. Restored afterwards (a thread's count also seeds later threads).
    """
    result: dict[str, Any] = {}

    def work() -> None:
        prior = torch.get_num_threads()
        try:
            if num_threads is not None:
                torch.set_num_threads(num_threads)
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc
        finally:
            torch.set_num_threads(prior)

    worker = threading.Thread(target=work, name=name)
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def other_num_threads() -> int:
    """An intra-op thread count different from this thread's (forces the global-state guard to miss)."""
    return 1 if torch.get_num_threads() != 1 else 2
