"""Torch-version-gated workarounds that keep selective activation checkpointing (SAC) in sync with FSDP2.

SAC caches op outputs in forward and replays them by ``(op, invocation index)`` in the backward recompute, so the
op stream inside a checkpointed region must be identical in both passes. FSDP2 units nested inside a region
(experts or an fp32 router sharded on their own inside a checkpointed block, or the block itself with
``activation_checkpointing.placement: outside``) break that in two ways:

1. Profiler ops. On torch 2.13, FSDP2 runs its hooks under ``torch.profiler.record_function``, which dispatches
   ``profiler._record_function_enter / _enter_new / _exit``. A nested unit whose pre-backward hook has not fired
   yet when its block recomputes runs its full pre/post-forward in the recompute, with a different number of those
   ops than in forward, and the first backward fails with::

       RuntimeError: profiler._record_function_enter_new.default invocation index 2 encountered during backward
       but not found in storage. This can happen if the operations in the checkpointed region are
       nondeterministic or depend on global state that changed between forward and backward.

   ``ensure_profiler_ops_sac_ignored()`` adds every overload of the three ops to
   ``torch.utils.checkpoint.SAC_IGNORED_OPS`` (torch >= 2.13 by release tuple, so 2.13.0a0+<hash> counts).

2. FSDP's own parameter management. With explicit prefetch a unit is all-gathered by its predecessor's hook
   *outside* the region in forward but by its own hook *inside* the region in recompute, so
   ``fsdp.all_gather_copy_in``, ``c10d._allgather_base_`` and ``aten.empty.memory_format`` appear only in
   recompute (and, with explicit backward prefetch, the reverse). Ignoring the profiler ops is not enough; the
   error then names one of those ops. Ignoring them as well would not be enough either: FSDP's copy-out also emits
   ``aten.copy_`` / ``split_with_sizes_copy`` that the model emits too, shifting their invocation indices, and a
   policy that MUST_SAVEs such an op would *replay* a cached result in recompute instead of running it, leaving
   the unsharded parameters unfilled. ``install_fsdp_hooks_outside_sac(model)`` therefore brackets every FSDP
   unit's forward pre/post hooks so that the nemo_ac SAC dispatch modes pass them straight through: FSDP's ops
   are neither counted, cached nor replayed; they always run for real, in forward and in recompute, exactly as
   FSDP decides. The model's op stream, which is what SAC is meant to cache, stays identical in both passes.

Both are no-ops on older torch releases; see the gates below.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

# The three profiler ops FSDP2's ``record_function`` dispatches on torch 2.13 (all overloads are added).
PROFILER_NAMESPACE = "profiler"
PROFILER_OP_NAMES = ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
# First release whose FSDP2 hooks dispatch profiler ops inside SAC regions (release tuple, pre-releases count).
PROFILER_OPS_SINCE = (2, 13)
# The FSDP-hook bypass changes nothing but which ops SAC sees; it is correct wherever FSDP2's hooks are module
# forward hooks and SAC uses torch's caching/cached dispatch-mode pair, i.e. every torch nemo_ac supports
# (pyproject: >=2.12). Verified on 2.13.0. Older releases are left alone: their SAC internals were not checked.
FSDP_HOOKS_OUTSIDE_SAC_SINCE = (2, 12)

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")
_HANDLES_ATTR = "_nemo_ac_fsdp_hooks_outside_sac"


def torch_version_release(version: str | None = None) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a torch version string (default: the running torch).

    Pre-release and local suffixes are dropped, so ``2.13.0a0+8145d630e8`` and ``2.13.0.dev20260101`` are
    ``(2, 13, 0)``: nightly and NGC builds of a release already carry its FSDP2 code. Unparseable -> ``(0, 0, 0)``
    (every gate stays off).
    """
    text = str(torch.__version__ if version is None else version)
    match = _RELEASE.match(text)
    if match is None:
        return (0, 0, 0)
    return (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))


def profiler_op_overloads() -> list[Any]:
    """Every overload of the profiler ops that exists in this torch (missing namespace / op / overload: skipped).

    ``torch.ops.<ns>`` is created lazily for any name, so a missing op shows up as AttributeError/RuntimeError on
    the op lookup; both are treated as "not present".
    """
    namespace = getattr(torch.ops, PROFILER_NAMESPACE, None)
    if namespace is None:
        return []
    overloads = []
    for name in PROFILER_OP_NAMES:
        try:
            packet = getattr(namespace, name)
            names = packet.overloads()
        except (AttributeError, RuntimeError):
            continue
        for overload in names:
            try:
                overloads.append(getattr(packet, overload))
            except (AttributeError, RuntimeError):
                continue
    return overloads


def ensure_profiler_ops_sac_ignored(*, torch_version: str | None = None) -> tuple[Any, ...]:
    """Add the profiler ops to ``torch.utils.checkpoint.SAC_IGNORED_OPS``; returns the ops it added.

    Prevents, on torch >= 2.13 with an FSDP2 unit inside a SAC region::

        RuntimeError: profiler._record_function_enter_new.default invocation index N encountered during
        backward but not found in storage.

    Ignored ops run normally in both passes and are never counted, which is right for the profiler ops: they only
    push/pop profiler ranges and return a handle. Idempotent; a no-op below torch 2.13 (``torch_version``
    overrides the running version, for tests), when the set or the ops do not exist, or when upstream already
    ignores them. This mutates torch's module-level set on purpose (the checkpoint modes read it per op); it is
    called from the SAC context factories, never at import time.
    """
    if torch_version_release(torch_version) < PROFILER_OPS_SINCE:
        return ()
    ignored = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", None)
    if not isinstance(ignored, set):
        return ()
    added = tuple(op for op in profiler_op_overloads() if op not in ignored)
    ignored.update(added)
    return added


# torch's own ignore set as this process found it when nemo_ac was imported (read, never written), so that an
# upstream fix can be told apart from nemo_ac's own addition (``nemo-ac doctor``, ``nemo_ac.compat.status``).
_IGNORED_AT_IMPORT = frozenset(getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", None) or ())


def profiler_ops_ignored_upstream() -> bool:
    """True when every profiler-op overload was already in ``SAC_IGNORED_OPS`` before nemo_ac touched it (a torch
    that fixed the desync itself, or another library that applied the same ignore first)."""
    overloads = profiler_op_overloads()
    return bool(overloads) and all(op in _IGNORED_AT_IMPORT for op in overloads)


# ------------------------------------------------------------------------------------------------------------
# FSDP2 hooks outside the SAC dispatch modes

_hook_state = threading.local()


def fsdp_hook_running() -> bool:
    """True while an FSDP2 forward hook runs on this thread (the nemo_ac SAC modes then pass ops through)."""
    return getattr(_hook_state, "depth", 0) > 0


def reset_fsdp_hook_state() -> None:
    """Forget a bracket left open by an exception inside an FSDP hook (called when a SAC region starts: regions
    never start inside an FSDP hook)."""
    _hook_state.depth = 0


@contextmanager
def ops_outside_sac() -> Iterator[None]:
    """Run a block of code with the nemo_ac SAC modes passing its ops through (what the FSDP brackets do)."""
    _enter_bracket()
    try:
        yield
    finally:
        _exit_bracket()


def _enter_bracket(*_: Any) -> None:
    _hook_state.depth = getattr(_hook_state, "depth", 0) + 1


def _exit_bracket(*_: Any) -> None:
    _hook_state.depth = max(getattr(_hook_state, "depth", 0) - 1, 0)


def _dynamo_disabled(fn):
    # FSDP2 marks its own hooks dynamo-disabled; the brackets around them must not be traced either (Dynamo would
    # treat the thread-local as a constant). Resolved defensively: torch._disable_dynamo is private.
    disable = getattr(torch, "_disable_dynamo", None)
    return disable(fn, recursive=True) if disable is not None else fn


_enter_hook = _dynamo_disabled(_enter_bracket)
_exit_hook = _dynamo_disabled(_exit_bracket)


def fsdp_hooks_outside_sac_supported(*, torch_version: str | None = None) -> bool:
    return torch_version_release(torch_version) >= FSDP_HOOKS_OUTSIDE_SAC_SINCE


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def install_fsdp_hooks_outside_sac(model: nn.Module, *, torch_version: str | None = None) -> int:
    """Bracket the forward pre/post hooks of every FSDP2 unit in ``model``; returns how many units it bracketed.

    Must run after ``fully_shard`` (FSDP registers its pre-hook with ``prepend=True`` and its post-hook appended):
    the opening pre-hook is prepended in front of FSDP's, the closing pre-hook appended after it, the opening
    post-hook prepended and the closing post-hook appended with ``always_call=True`` (so an exception in forward
    closes the bracket). Only public ``register_forward_*_hook`` is used; FSDP's hooks themselves are untouched.
    nemo_ac registers no other hooks on these modules, so exactly FSDP's hooks run inside the brackets.
    Idempotent per module; a no-op below ``FSDP_HOOKS_OUTSIDE_SAC_SINCE``.
    """
    fsdp_type = _fsdp_module_type()
    if fsdp_type is None or not fsdp_hooks_outside_sac_supported(torch_version=torch_version):
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, fsdp_type) or getattr(module, _HANDLES_ATTR, None):
            continue
        handles = (
            module.register_forward_pre_hook(_enter_hook, prepend=True),
            module.register_forward_pre_hook(_exit_hook),
            module.register_forward_hook(_enter_hook, prepend=True),
            module.register_forward_hook(_exit_hook, always_call=True),
        )
        object.__setattr__(module, _HANDLES_ATTR, handles)
        count += 1
    return count


def remove_fsdp_hooks_outside_sac(model: nn.Module) -> int:
    """Undo ``install_fsdp_hooks_outside_sac`` (tests compare layouts with and without it)."""
    count = 0
    for module in model.modules():
        handles = getattr(module, _HANDLES_ATTR, None)
        if not handles:
            continue
        for handle in handles:
            handle.remove()
        object.__setattr__(module, _HANDLES_ATTR, None)
        count += 1
    return count
