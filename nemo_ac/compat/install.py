"""``install()``: the process-wide workaround this torch needs, applied on request and reversible.

Only one of nemo_ac's workarounds is process-wide: FSDP2 runs its hooks under ``record_function``, whose ``profiler._record_function_enter_new / _enter / _exit`` ops enter every SAC region that holds an FSDP2 unit
(a nested expert / router unit, or the block itself when the checkpoint sits outside its ``fully_shard``). The
recompute then sees another number of them than the forward, and from torch 2.13 on (its SAC replays the recompute
by invocation index) the first backward fails with::

    RuntimeError: profiler._record_function_enter_new.default invocation index 2 encountered during backward but
    not found in storage. This can happen if the operations in the checkpointed region are nondeterministic or
    depend on global state that changed between forward and backward.

The fix adds every overload of those ops to ``torch.utils.checkpoint.SAC_IGNORED_OPS`` (a module-level set that
torch's SAC modes read per op), so it helps any SAC policy, torch's own ``create_selective_checkpoint_contexts``
included. Gated on the release tuple ``>= (2, 13)`` (``2.13.0a0+<hash>`` counts), a no-op when torch already
ignores them. The per-model and per-region pieces (FSDP hooks outside the SAC modes, the forward-thread compile
context) cannot be global; see ``nemo_ac.compat.regions``.

Nothing here runs at import time. ``installed()`` restores the exact prior content of the set, for tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from nemo_ac.workarounds.gates import gate_active
from nemo_ac.workarounds.profiler_ops_in_sac import (
    ensure_profiler_ops_sac_ignored,
    profiler_op_overloads,
    profiler_ops_ignored_upstream,
    sac_ignored_ops,
)

_lock = threading.Lock()
_added: set[Any] = set()  # ops install() added to SAC_IGNORED_OPS (uninstall removes exactly these)


@dataclass(frozen=True)
class CompatStatus:
    """What ``install()`` did, and which per-model / per-region helpers this torch needs.

    profiler_ops: ``"added"`` (install added them now), ``"installed"`` (present from an earlier install or a
        nemo_ac SAC factory), ``"upstream"`` (present before nemo_ac: torch or another library ignores them),
        ``"not_needed"`` (torch below 2.13: its SAC recompute asks the policy again and runs the extra ops), ``"unavailable"`` (this
        torch has no ``SAC_IGNORED_OPS`` or no profiler ops).
    """

    torch_version: str
    profiler_ops: str
    added_ops: tuple[str, ...]
    fsdp_units_need_protection: bool  # call protect_fsdp_units(model) after fully_shard (explicit prefetch)
    recompute_needs_thread_context: bool  # use forward_thread_compile_context for AC(compile(block)) regions

    def summary(self) -> str:
        return (
            f"torch {self.torch_version}: profiler ops in SAC_IGNORED_OPS: {self.profiler_ops}; "
            f"protect_fsdp_units needed: {self.fsdp_units_need_protection}; "
            f"forward-thread compile context needed: {self.recompute_needs_thread_context}"
        )


def _ignored_set() -> set[Any] | None:
    return sac_ignored_ops()


def status(*, torch_version: str | None = None) -> CompatStatus:
    """The current state, without changing anything."""
    return _status(torch_version=torch_version, added=())


def _status(*, torch_version: str | None, added: tuple[Any, ...]) -> CompatStatus:
    ignored = _ignored_set()
    overloads = profiler_op_overloads()
    if ignored is None or not overloads:
        profiler = "unavailable"
    elif added:
        profiler = "added"
    elif profiler_ops_ignored_upstream():
        profiler = "upstream"
    elif all(op in ignored for op in overloads):
        profiler = "installed"
    elif not gate_active("profiler_ops_in_sac", torch_version=torch_version):
        profiler = "not_needed"
    else:
        profiler = "missing"
    return CompatStatus(
        torch_version=str(torch.__version__ if torch_version is None else torch_version),
        profiler_ops=profiler,
        added_ops=tuple(str(op) for op in added),
        fsdp_units_need_protection=gate_active("fsdp_hooks_in_sac", torch_version=torch_version),
        recompute_needs_thread_context=gate_active("forward_thread_compile_config", torch_version=torch_version),
    )


def install(*, torch_version: str | None = None) -> CompatStatus:
    """Apply every process-wide workaround the running torch needs; idempotent and version-gated.

    torch_version: decide the gates as if this torch version were running (the doctor uses it to show what an
        older release would get); default the running torch.
    """
    with _lock:
        added = ensure_profiler_ops_sac_ignored(torch_version=torch_version)
        _added.update(added)
    return _status(torch_version=torch_version, added=added)


def uninstall() -> int:
    """Remove what ``install()`` added (nothing else: ops torch or other libraries ignore stay). Returns the count."""
    with _lock:
        ignored = _ignored_set()
        removed = 0
        if ignored is not None:
            for op in _added:
                if op in ignored:
                    ignored.discard(op)
                    removed += 1
        _added.clear()
    return removed


@contextmanager
def installed(*, torch_version: str | None = None) -> Iterator[CompatStatus]:
    """``install()`` for the duration; afterwards ``SAC_IGNORED_OPS`` holds exactly what it held before (also what
    anything else added meanwhile, e.g. another library's SAC factory, is removed again)."""
    ignored = _ignored_set()
    before = set(ignored) if ignored is not None else None
    with _lock:
        added_before = set(_added)
    try:
        yield install(torch_version=torch_version)
    finally:
        with _lock:
            if ignored is not None and before is not None:
                ignored.clear()
                ignored.update(before)
            _added.clear()
            _added.update(added_before)
