"""Recompute contexts of an activation checkpoint, and the one SAC context factory.

Every AC wrapper gets one ``context_fn`` composed from independent recompute contexts (the SAC modes, the
forward-thread compile context, ...), so each concern stays in its own module. nemo_ac's SAC modes are torch's
caching/cached pair re-classed (``workarounds.sac_mode_passthrough``) so that two kinds of ops run straight through,
neither counted, cached nor replayed: ops of an FSDP2 unit's hooks (``workarounds.fsdp_hooks_in_sac``) and whole
inductor-compiled regions (``workarounds.compiled_regions_under_sac``); torch's storage error is re-raised as
``SACDesyncError`` naming the region (``diagnostics.sac_explain``).

The tensors SAC caches bypass surrounding ``saved_tensors_hooks`` (``SAC_CACHE_THROUGH_SAVED_TENSORS_HOOKS``): the
behaviour nemo_ac is built and tested on (its memory accounting counts SAC's cache apart from what autograd packs,
and validation rejects ``offload`` with ``mode: selective`` because the offloader's hooks never see that cache).
torch 2.14 made this a choice, warned about when left open and due to become an error
(``workarounds.sac_mode_passthrough``), so nemo_ac states it on every SAC region and every checkpoint call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from nemo_ac.config.schema import SelectiveACConfig
from nemo_ac.diagnostics.sac_explain import DecisionLog, explain_sac_desync
from nemo_ac.distributed.activation_checkpointing.policy import PolicyRules, SelectivePolicy
from nemo_ac.workarounds.compiled_regions_under_sac import is_compiled_region
from nemo_ac.workarounds.fsdp_hooks_in_sac import fsdp_hook_running, reset_fsdp_hook_state
from nemo_ac.workarounds.profiler_ops_in_sac import ensure_profiler_ops_sac_ignored
from nemo_ac.workarounds.sac_mode_passthrough import passthrough_sac_modes

# Whether SAC-cached tensors go through surrounding saved-tensor hooks (torch >= 2.14 lets the caller choose).
SAC_CACHE_THROUGH_SAVED_TENSORS_HOOKS = False

ContextFn = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]
PolicyFn = Callable[..., Any]


def compose_context_fns(context_fns: Sequence[ContextFn]) -> ContextFn:
    """One ``context_fn`` that enters each given pair: forward contexts in order, recompute contexts in order."""
    fns = list(context_fns)

    def context_fn() -> tuple[AbstractContextManager, AbstractContextManager]:
        pairs = [fn() for fn in fns]
        return _enter_all([p[0] for p in pairs]), _enter_all([p[1] for p in pairs])

    return context_fn


def _enter_all(managers: list[AbstractContextManager]) -> AbstractContextManager:
    if not managers:
        return contextlib.nullcontext()
    if len(managers) == 1:
        return managers[0]
    stack = contextlib.ExitStack()

    class _All(contextlib.AbstractContextManager):
        def __enter__(self):
            for manager in managers:
                stack.enter_context(manager)
            return self

        def __exit__(self, *exc):
            return stack.__exit__(*exc)

    return _All()


def _passes_through(func: Any) -> bool:
    """Ops the SAC modes neither count, cache nor replay: FSDP2's hook ops and whole compiled regions."""
    return fsdp_hook_running() or is_compiled_region(func)


def selective_region_modes(
    policy: PolicyFn | Sequence[Any], *, region: str = "", workarounds: bool = True
) -> tuple[AbstractContextManager, AbstractContextManager]:
    """torch's SAC mode pair for ``policy`` (a policy function or a list of ops to save, as
    ``create_selective_checkpoint_contexts`` takes), as nemo_ac's region modes (see the module docstring)."""

    def explain(exc: RuntimeError) -> BaseException | None:
        return explain_sac_desync(exc, region=region, torch_version=torch.__version__, workarounds=workarounds)

    return passthrough_sac_modes(
        policy,
        passes_through=_passes_through,
        on_region_start=reset_fsdp_hook_state,
        explain_storage_error=explain,
        respect_saved_tensors_hooks=SAC_CACHE_THROUGH_SAVED_TENSORS_HOOKS,
    )


def make_selective_checkpoint_context_fn(
    *,
    config: SelectiveACConfig | None = None,
    region: str = "",
    workarounds: bool = True,
    extra_save_ops: Sequence[Any] = (),
    policy: PolicyFn | Sequence[Any] | None = None,
    policy_factory: Callable[[], PolicyFn] | None = None,
    install_profiler_ignore: bool | None = None,
) -> ContextFn:
    """The SAC context factory (nemo_ac's blocks and ``nemo_ac.compat`` alike): ``context_fn() -> (caching mode,
    cached mode)`` for one region.

    config / extra_save_ops: nemo_ac's policy (a fresh ``SelectivePolicy`` per region invocation: its matmul counter
        restarts in every region, so forward and recompute agree), used unless ``policy`` or ``policy_factory``.
    policy: a policy shared by every invocation (a function or a list of ops, as torch takes); policy_factory: a
        zero-argument callable giving a fresh policy per invocation (for stateful policies).
    region: a name for ``SACDesyncError``.
    workarounds: install the profiler-op ignore (``workarounds.profiler_ops_in_sac``); False only to observe the
        torch failure. (The FSDP-hook brackets go on the model after fully_shard, see ``parallelize``.)
    install_profiler_ignore: overrides ``workarounds`` for the install alone (``nemo_ac.compat`` leaves that to
        ``compat.install()``, process-wide and reversible).
    """
    if policy is not None and policy_factory is not None:
        raise ValueError("pass policy or policy_factory, not both")
    if workarounds if install_profiler_ignore is None else install_profiler_ignore:
        ensure_profiler_ops_sac_ignored()
    if policy is None and policy_factory is None:
        rules = PolicyRules.build(config if config is not None else SelectiveACConfig(), extra_save_ops=extra_save_ops)
        log = DecisionLog.from_env()

        def policy_factory() -> PolicyFn:
            return SelectivePolicy(rules=rules, region=region, log=log)

    def context_fn() -> tuple[AbstractContextManager, AbstractContextManager]:
        chosen = policy if policy is not None else policy_factory()
        return selective_region_modes(chosen, region=region, workarounds=workarounds)

    return context_fn
