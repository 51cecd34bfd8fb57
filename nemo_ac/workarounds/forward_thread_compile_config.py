"""The recompute of AC(compile(block)) compiles with the *autograd thread's* Dynamo config, not the forward's.

Errors prevented (torch >= 2.12, ``compile.layout: ac_outer``; on GPU always, on CPU when backward runs on another
thread, ``train.backward_on_thread``)::

    torch._dynamo hit config.recompile_limit (8)
    CheckpointError: torch.utils.checkpoint: Recomputed values for the following tensors have different metadata
    than during the forward pass.

(under SAC also "... encountered during backward but not found in storage").

Why: ``torch._dynamo.config`` and ``torch.compiler.config`` are per thread since 2.12 (every key a ``ContextVar``).
On GPU, backward runs on the autograd device thread, so a recompute that re-enters Dynamo (after any cache miss, e.g.
a global-state guard on that thread's intra-op thread count) compiles with that thread's *defaults*: recompile_limit
8, capture_scalar_outputs False, no dynamic_sources. Per-batch shapes recompile until the limit and the block runs
eagerly in the recompute while the forward ran compiled; the experts loop's ``tokens_per_expert.tolist()``
graph-breaks in the recompute only; either way the replay fails.

Fix: ``forward_thread_compile_context`` is a checkpoint ``context_fn`` that captures the forward thread's
non-default compile settings when the checkpoint runs its forward and re-applies them around the recompute, on
whatever thread that is. Not for compile(AC(block)): there the recompute is planned inside the graph and no thread
re-enters Dynamo. The private piece is ``ConfigModule._get_dict`` (``_non_default_values``), with an explicit key
list as fallback.

Upstream: pytorch/pytorch#186537 (the regression; open), pytorch/pytorch#191777 (``AutogradContextVar``; open),
pytorch/pytorch#186583 (propagate contextvars to autograd callbacks; closed).
Delete when: a torch release runs backward-thread callbacks under the launching thread's context (``nemo-ac
doctor`` rows ``thread_config`` and ``recompute_thread`` pass without the workaround); set ``until`` in
``gates.GATES["forward_thread_compile_config"]``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Config modules whose values are per thread (torch >= 2.12) and shape what a recompute compiles: Dynamo (limits,
# dynamic_sources via torch.compiler, capture_scalar_outputs, skip_fwd_side_effects_in_bwd_under_checkpoint, ...),
# AOTAutograd's partitioner (torch._functorch.config) and Inductor's code generation.
_THREAD_CONFIG_MODULES = (
    "torch._dynamo.config",
    "torch.compiler.config",
    "torch._functorch.config",
    "torch._inductor.config",
)

# If a torch release drops ConfigModule._get_dict, capture at least these (the ones the failure above needs).
_FALLBACK_KEYS = {
    "torch._dynamo.config": (
        "recompile_limit",
        "accumulated_recompile_limit",
        "capture_scalar_outputs",
        "capture_dynamic_output_shape_ops",
        "automatic_dynamic_shapes",
        "assume_static_by_default",
        "specialize_int",
        "allow_unspec_int_on_nn_module",
        "skip_fwd_side_effects_in_bwd_under_checkpoint",
        "fail_on_recompile_limit_hit",
    ),
    "torch.compiler.config": ("dynamic_sources", "unbacked_sources"),
}


@contextlib.contextmanager
def patched_config(module: ModuleType, changes: Mapping[str, Any]) -> Iterator[None]:
    """``module.patch(changes)`` without its cost: ``ConfigModule.patch`` defines a class per call (~0.3 ms, paid
    per block per micro batch here); plain setattr / restore is ~30 us and has the same thread-local effect."""
    if not changes:
        yield
        return
    prior = {key: getattr(module, key) for key in changes}
    try:
        for key, value in changes.items():
            setattr(module, key, value)
        yield
    finally:
        for key, value in prior.items():
            setattr(module, key, value)


@functools.cache
def _config_modules() -> tuple[tuple[str, ModuleType], ...]:
    found = []
    for name in _THREAD_CONFIG_MODULES:
        try:
            found.append((name, importlib.import_module(name)))
        except ImportError:
            continue
    return tuple(found)


def _non_default_values(name: str, module: ModuleType) -> dict[str, Any]:
    """The values this thread changed from their defaults.

    Uses the private ``ConfigModule._get_dict(skip_default=True, readonly_values=True)`` (cached per thread, so a
    capture per checkpoint call costs microseconds); resolved defensively, falling back to an explicit key list.
    """
    get_dict = getattr(module, "_get_dict", None)
    if get_dict is not None:
        try:
            return dict(get_dict(skip_default=True, readonly_values=True))
        except TypeError:
            pass
    return {key: getattr(module, key) for key in _FALLBACK_KEYS.get(name, ()) if hasattr(module, key)}


def capture_thread_compile_config() -> dict[str, dict[str, Any]]:
    """This thread's non-default compile settings, per config module name."""
    return {name: _non_default_values(name, module) for name, module in _config_modules()}


def _differs(module: ModuleType, key: str, value: Any) -> bool:
    try:
        return bool(getattr(module, key) != value)
    except Exception:  # an exotic value without a usable __eq__: set it anyway
        return True


@contextlib.contextmanager
def apply_thread_compile_config(captured: Mapping[str, Mapping[str, Any]]) -> Iterator[None]:
    """Set the captured values on the calling thread (only those that differ) for the duration."""
    modules = dict(_config_modules())
    with contextlib.ExitStack() as stack:
        for name, values in captured.items():
            module = modules.get(name)
            if module is None:
                continue
            changes = {key: value for key, value in values.items() if _differs(module, key, value)}
            stack.enter_context(patched_config(module, changes))
        yield


def _always_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def forward_thread_compile_context() -> tuple[AbstractContextManager, AbstractContextManager]:
    """A checkpoint ``context_fn``: capture now (forward thread), re-apply around the recompute (any thread).

    When the checkpoint itself is being traced (``torch.compiler.is_compiling()``: a compile(AC(...)) region) the
    recompute is planned inside the graph and no thread re-enters Dynamo, so nothing is captured. Under compile
    torch asserts "In torch.compile mode, `context_fn` arg passed to `torch.utils.checkpoint` must generate a
    tuple of two `TorchDispatchMode`s" (2.13), so that case returns the pair Dynamo itself uses for plain AC (every
    op PREFER_RECOMPUTE) instead of null contexts. nemo_ac attaches this context only to ac_outer blocks, where the
    checkpoint runs eagerly (the parallel plan's recompute contexts).
    """
    if torch.compiler.is_compiling():
        return create_selective_checkpoint_contexts(_always_recompute)
    return contextlib.nullcontext(), apply_thread_compile_config(capture_thread_compile_config())
