"""Per-model and per-region helpers for FSDP2 trainers that do not use nemo_ac's trainer.

They work with plain ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, context_fn=...)`` and with
torchtitan-style ``checkpoint_wrapper(module, context_fn=...)``:

- ``selective_checkpoint_context_fn(policy)``: the SAC ``context_fn`` for your own policy (or nemo_ac's). Its modes
  are torch's caching/cached pair, re-classed so that ops run by a protected FSDP2 unit's hooks pass through
  (neither counted, cached nor replayed) and a storage error names the region (``SACDesyncError``).
- ``protect_fsdp_units(model)``: after ``fully_shard``. With explicit prefetch (``set_modules_to_forward_prefetch``
  / ``..._backward_prefetch``) a nested unit is all-gathered by its predecessor's hook outside the region in
  forward but by its own hook inside it in recompute, so with the profiler ops ignored the backward still fails::

      RuntimeError: fsdp.all_gather_copy_in.default encountered during backward but not found in storage

  Ignoring FSDP's ops is not safe (its copy-out emits ``aten.copy_`` / ``split_with_sizes_copy`` that the model
  emits too); instead the units' forward hooks are bracketed so FSDP's parameter management always runs for real.
  Only the modes from ``selective_checkpoint_context_fn`` honour the brackets: torch's own modes do not know them.
- ``ac_outer_compile_kwargs(kwargs)``: ``torch.compile`` kwargs for a block compiled *inside* a SAC region
  (AC(compile(block))): inductor then runs each compiled graph as one ``inductor_compiled_code`` op, which the
  modes above pass through; without it SAC caches buffers inductor overwrites (silently wrong gradients).
- ``forward_thread_compile_context`` / ``with_forward_thread_compile_context(context_fn)``: for AC(compile(block))
  regions. Dynamo's config is per thread since torch 2.12 and the recompute runs on the autograd thread (the device
  thread on GPU), so after a cache miss it compiles with that thread's defaults (recompile_limit 8,
  capture_scalar_outputs False, no dynamic_sources) and fails with ``CheckpointError: ... Recomputed values for the
  following tensors have different metadata than during the forward pass``. The context re-applies the forward
  thread's settings around the recompute.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper

from nemo_ac.config.schema import SelectiveACConfig
from nemo_ac.distributed.activation_checkpointing import (
    ContextFn,
    compose_context_fns,
    sac_region_context_fn,
    selective_policy_factory,
)
from nemo_ac.workarounds.compiled_regions_under_sac import ac_outer_compile_kwargs
from nemo_ac.workarounds.forward_thread_compile_config import forward_thread_compile_context
from nemo_ac.workarounds.fsdp_hooks_in_sac import (
    UnprotectedFSDPUnitWarning,
    fsdp_hooks_outside_sac_supported,
    fsdp_units,
    install_fsdp_hooks_outside_sac,
    remove_fsdp_hooks_outside_sac,
)
from nemo_ac.workarounds.sac_mode_passthrough import is_passthrough_mode, is_torch_sac_mode

PolicyFn = Callable[..., Any]

__all__ = [
    "ContextFn",
    "UnprotectedFSDPUnitWarning",
    "ac_outer_compile_kwargs",
    "add_recompute_context",
    "compose_context_fns",
    "forward_thread_compile_context",
    "protect_fsdp_units",
    "selective_checkpoint_context_fn",
    "unprotect_fsdp_units",
    "with_forward_thread_compile_context",
]


def selective_checkpoint_context_fn(
    policy: PolicyFn | Sequence[Any] | None = None,
    *,
    policy_factory: Callable[[], PolicyFn] | None = None,
    config: SelectiveACConfig | None = None,
    region: str = "",
    compile_context: bool = False,
) -> ContextFn:
    """A SAC ``context_fn`` whose modes let protected FSDP2 units' hook ops through (compat's SAC factory: your
    policy or nemo_ac's; installs nothing process-wide, ``compat.install()`` does).

    policy: what ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` accepts (a function
        ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` or a list of ops to save), shared by every region
        invocation. None (and no factory): nemo_ac's policy (compute-intensive ops, every other matmul, router
        top-k/sort, collectives; never a mutating op), fresh per invocation.
    policy_factory: a zero-argument callable returning a fresh policy per region invocation, for stateful
        policies (a matmul counter must restart in every region, or forward and recompute disagree).
    config: nemo_ac's policy options when ``policy`` is None.
    region: a name for error messages (``SACDesyncError`` says which region desynced).
    compile_context: also re-apply the forward thread's compile settings in the recompute
        (``with_forward_thread_compile_context``), for regions that hold a compiled module.
    """
    if policy is not None and policy_factory is not None:
        raise ValueError("pass policy or policy_factory, not both")
    if policy is not None:
        policy_factory = _shared(policy)
    elif policy_factory is None:
        policy_factory = selective_policy_factory(config, region=region)
    context_fn = sac_region_context_fn(policy_factory, region=region)
    return with_forward_thread_compile_context(context_fn) if compile_context else context_fn


def _shared(policy: PolicyFn | Sequence[Any]) -> Callable[[], PolicyFn | Sequence[Any]]:
    """One policy for every region invocation (what torch's ``create_selective_checkpoint_contexts`` takes)."""
    return lambda: policy


def with_forward_thread_compile_context(context_fn: ContextFn) -> ContextFn:
    """``context_fn`` plus the forward-thread compile context in its recompute.

    While the checkpoint is being traced (compile(AC(...)): ``torch.compiler.is_compiling()``) the recompute is
    planned inside the graph and no thread re-enters Dynamo, and torch requires the context to be a pair of
    ``TorchDispatchMode``s, so ``context_fn``'s own pair is returned unchanged there.
    """

    def composed() -> tuple[AbstractContextManager, AbstractContextManager]:
        if torch.compiler.is_compiling():
            return context_fn()
        return compose_context_fns([context_fn, forward_thread_compile_context])()

    return composed


def protect_fsdp_units(model: nn.Module, *, torch_version: str | None = None) -> int:
    """Run every FSDP2 unit's forward hooks outside nemo_ac's SAC modes; call after ``fully_shard``.

    Returns the number of units newly protected (0 on a second call: idempotent). Raises when ``model`` holds no
    FSDP2 unit (called too early: it would protect nothing). Warns (``UnprotectedFSDPUnitWarning``) when a
    ``checkpoint_wrapper`` in ``model`` builds its SAC region with torch's own modes
    (``create_selective_checkpoint_contexts``, as torchtitan and NeMo Automodel do), and again, once, the first time
    a protected unit runs inside such a region (a ``checkpoint(..., context_fn=...)`` call this function cannot
    see): those modes do not know the brackets, so the explicit-prefetch layouts would still fail with torch's raw
    ``fsdp.all_gather_copy_in.default ... not found in storage``. A no-op (returns 0) on torch releases outside the
    gate (``nemo_ac.workarounds.gates.GATES["fsdp_hooks_in_sac"]``).
    """
    if not fsdp_hooks_outside_sac_supported(torch_version=torch_version):
        return 0
    if not fsdp_units(model):
        raise RuntimeError(
            "protect_fsdp_units found no FSDP2 unit in the model: call it after fully_shard(...) of the model"
        )
    unaware = regions_with_torch_sac_modes(model)
    if unaware:
        warnings.warn(
            f"protect_fsdp_units: the checkpoint of {', '.join(unaware[:3])}{' ...' if len(unaware) > 3 else ''} "
            "builds its SAC region with torch's own modes (create_selective_checkpoint_contexts), which run the "
            "protected FSDP hooks' ops through SAC anyway, so explicit prefetch still fails with 'fsdp.all_gather_"
            "copy_in.default ... not found in storage'. Build its context_fn with "
            "nemo_ac.compat.selective_checkpoint_context_fn(policy=your_policy) (same policy, modes that honour "
            "the protection)",
            UnprotectedFSDPUnitWarning,
            stacklevel=2,
        )
    return install_fsdp_hooks_outside_sac(model, torch_version=torch_version, warn_on_torch_sac_modes=True)


def regions_with_torch_sac_modes(model: nn.Module) -> list[str]:
    """Names of ``checkpoint_wrapper`` modules whose ``context_fn`` returns torch's own SAC modes (not nemo_ac's
    pass-through ones). Each wrapper's ``context_fn`` is called once, outside any checkpoint, to see its modes."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, CheckpointWrapper):
            continue
        context_fn = (getattr(module.checkpoint_fn, "keywords", None) or {}).get("context_fn")
        if context_fn is None:
            continue
        modes = context_fn()
        if any(is_torch_sac_mode(mode) and not is_passthrough_mode(mode) for mode in modes):
            found.append(name or type(module).__name__)
    return found


def unprotect_fsdp_units(model: nn.Module) -> int:
    """Undo ``protect_fsdp_units``; returns the number of units unprotected."""
    return remove_fsdp_hooks_outside_sac(model)


def add_recompute_context(model: nn.Module, context_fn: ContextFn = forward_thread_compile_context) -> int:
    """Compose ``context_fn`` into every non-reentrant ``checkpoint_wrapper`` already in ``model``.

    For trainers that wrap blocks themselves (torchtitan, NeMo Automodel's parallelizer): their wrappers keep the
    checkpoint call as ``functools.partial(checkpoint, use_reentrant=False, context_fn=...)``. The new recompute
    context runs after the wrapper's own one (SAC modes first); under ``torch.compiler.is_compiling()`` the
    wrapper's own pair is used alone (see ``with_forward_thread_compile_context``). Returns the number of wrappers
    changed; wrappers without a partial checkpoint function (reentrant, custom) are left alone.
    """
    count = 0
    for module in model.modules():
        if not isinstance(module, CheckpointWrapper):
            continue
        keywords = getattr(module.checkpoint_fn, "keywords", None)
        if keywords is None or module.checkpoint_impl != CheckpointImpl.NO_REENTRANT:
            continue
        own = keywords.get("context_fn")
        keywords["context_fn"] = _compose_with_own(own, context_fn)
        count += 1
    return count


def _compose_with_own(own: ContextFn | None, extra: ContextFn) -> ContextFn:
    if extra is forward_thread_compile_context:
        return forward_thread_compile_context if own is None else with_forward_thread_compile_context(own)
    return extra if own is None else compose_context_fns([own, extra])
