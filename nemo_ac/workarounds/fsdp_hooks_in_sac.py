"""FSDP2's own parameter management inside a selective-AC region (explicit prefetch layouts).

Error prevented (with the profiler ops already ignored, ``profiler_ops_in_sac``; explicit forward or backward
prefetch, ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``)::

    RuntimeError: fsdp.all_gather_copy_in.default encountered during backward but not found in storage

Why (torch >= 2.13, where SAC's recompute looks every op up by invocation index; 2.12.1 asked the policy again and
ran the extra ops, doctor: not affected): with explicit prefetch a nested unit is all-gathered by its predecessor's hook *outside* the region in forward
but by its own hook *inside* the region in recompute, so ``fsdp.all_gather_copy_in``, ``c10d._allgather_base_`` and
``aten.empty.memory_format`` appear only in recompute (with explicit backward prefetch, the reverse). Ignoring them
in ``SAC_IGNORED_OPS`` is not enough: FSDP's copy-out also emits ``aten.copy_`` / ``split_with_sizes_copy``, which
the model emits too, shifting their invocation indices, and a policy that MUST_SAVEs such an op would *replay* a
cached result in recompute instead of running it, leaving the unsharded parameters unfilled.

Fix: every FSDP2 unit's forward pre/post hooks are bracketed (``install_fsdp_hooks_outside_sac``); while a bracket is
open on a thread (``fsdp_hook_running``), nemo_ac's SAC modes (``sac_mode_passthrough``) run each op directly:
FSDP's ops are neither counted, cached nor replayed; they always run for real, in forward and in recompute, as
FSDP decides. The model's op stream, which is what SAC caches, stays identical in both passes. Only public
``register_forward_*_hook`` is used; FSDP's hooks themselves are untouched. torch's own SAC modes do not know the
brackets (``nemo_ac.compat.protect_fsdp_units`` says so when it finds them).

Upstream: pytorch/pytorch#196862 (a scoped SAC bypass around FSDP all-gather launch and copy-out; closed
unmerged). NeMo Automodel instead adds FSDP's ops to ``SAC_IGNORED_OPS`` (NVIDIA-NeMo/Automodel#3330, #3961).
Delete when: a torch release keeps FSDP2's runtime ops out of SAC itself (``nemo-ac doctor`` row
``sac_fsdp_prefetch`` passes without the workaround); set ``until`` in ``gates.GATES["fsdp_hooks_in_sac"]``.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nemo_ac.workarounds.gates import gate_active
from nemo_ac.workarounds.sac_mode_passthrough import is_passthrough_mode, is_torch_sac_mode


class UnprotectedFSDPUnitWarning(UserWarning):
    """A bracketed FSDP2 unit ran inside a SAC region whose modes do not honour the brackets."""


_hook_state = threading.local()
# FSDP unit -> the four hook handles of its brackets (no attribute on the module: the registry of what is installed).
_BRACKETS: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ...]] = weakref.WeakKeyDictionary()


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


def _enter_bracket_checked(module: nn.Module, *_: Any) -> None:
    """``_enter_bracket`` for units another trainer protects (``nemo_ac.compat``): its SAC modes may be torch's."""
    _enter_bracket()
    if not _WARNED:
        _warn_if_sac_modes_ignore_brackets(module)


_WARNED: list[str] = []  # once per process


def _warn_if_sac_modes_ignore_brackets(module: nn.Module) -> None:
    """torch's own SAC modes (``create_selective_checkpoint_contexts`` as torchtitan and NeMo Automodel build them)
    count, cache and replay FSDP's ops whatever the brackets say; say so once, naming the unit, instead of letting
    the explicit-prefetch layouts fail later with torch's raw "... not found in storage" error."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if any(is_torch_sac_mode(mode) and not is_passthrough_mode(mode) for mode in _get_current_dispatch_mode_stack()):
        _WARNED.append(type(module).__name__)
        warnings.warn(
            f"nemo_ac.compat.protect_fsdp_units: FSDP unit {type(module).__name__} runs inside a SAC region built "
            "with torch's own modes (create_selective_checkpoint_contexts), which ignore the protection: with "
            "explicit FSDP prefetch its all-gather still desyncs the recompute ('fsdp.all_gather_copy_in.default ... "
            "not found in storage'). Build the region's context_fn with "
            "nemo_ac.compat.selective_checkpoint_context_fn(policy=your_policy)",
            UnprotectedFSDPUnitWarning,
            stacklevel=2,
        )


def _exit_bracket(*_: Any) -> None:
    _hook_state.depth = max(getattr(_hook_state, "depth", 0) - 1, 0)


def _dynamo_disabled(fn):
    # FSDP2 marks its own hooks dynamo-disabled; the brackets around them must not be traced either (Dynamo would
    # treat the thread-local as a constant). Resolved defensively: torch._disable_dynamo is private.
    disable = getattr(torch, "_disable_dynamo", None)
    return disable(fn, recursive=True) if disable is not None else fn


_enter_hook = _dynamo_disabled(_enter_bracket)
_enter_hook_checked = _dynamo_disabled(_enter_bracket_checked)
_exit_hook = _dynamo_disabled(_exit_bracket)


def fsdp_hooks_outside_sac_supported(*, torch_version: str | None = None) -> bool:
    return gate_active("fsdp_hooks_in_sac", torch_version=torch_version)


def fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    fsdp_type = fsdp_module_type()
    return [] if fsdp_type is None else [module for module in model.modules() if isinstance(module, fsdp_type)]


def install_fsdp_hooks_outside_sac(
    model: nn.Module, *, torch_version: str | None = None, warn_on_torch_sac_modes: bool = False
) -> int:
    """Bracket the forward pre/post hooks of every FSDP2 unit in ``model``; returns how many units it bracketed.

    Must run after ``fully_shard`` (FSDP registers its pre-hook with ``prepend=True`` and its post-hook appended):
    the opening pre-hook is prepended in front of FSDP's, the closing pre-hook appended after it, the opening
    post-hook prepended and the closing post-hook appended with ``always_call=True`` (so an exception in forward
    closes the bracket). nemo_ac registers no other hooks on these modules, so exactly FSDP's hooks run inside the
    brackets. Idempotent per module; a no-op outside the gate.

    warn_on_torch_sac_modes: check, at each unit's forward until it first warns, whether the enclosing SAC region
    uses torch's own modes, which ignore the brackets (``nemo_ac.compat.protect_fsdp_units`` sets it; nemo_ac's own
    regions always use the pass-through modes, so the parallelizer keeps the check off its hot path).
    """
    if not fsdp_hooks_outside_sac_supported(torch_version=torch_version):
        return 0
    enter = _enter_hook_checked if warn_on_torch_sac_modes else _enter_hook
    count = 0
    for module in fsdp_units(model):
        if module in _BRACKETS:
            continue
        _BRACKETS[module] = (
            module.register_forward_pre_hook(enter, prepend=True),
            module.register_forward_pre_hook(_exit_hook),
            module.register_forward_hook(enter, prepend=True),
            module.register_forward_hook(_exit_hook, always_call=True),
        )
        count += 1
    return count


def remove_fsdp_hooks_outside_sac(model: nn.Module) -> int:
    """Undo ``install_fsdp_hooks_outside_sac`` (tests compare layouts with and without it)."""
    count = 0
    for module in list(model.modules()):
        handles = _BRACKETS.pop(module, None)
        if not handles:
            continue
        for handle in handles:
            handle.remove()
        count += 1
    return count
