"""Recompute contexts of an activation checkpoint, and nemo_ac's SAC context factory.

Every AC wrapper gets one ``context_fn`` composed from independent recompute contexts (the SAC modes, the
forward-thread compile context, ...), so each concern stays in its own module. nemo_ac's SAC modes are torch's
caching/cached pair re-classed (``workarounds.sac_mode_passthrough``) so that two kinds of ops run straight through,
neither counted, cached nor replayed: ops of an FSDP2 unit's hooks (``workarounds.fsdp_hooks_in_sac``) and whole
inductor-compiled regions (``workarounds.compiled_regions_under_sac``); torch's storage error is re-raised as
``SACDesyncError`` naming the region (``diagnostics.sac_explain``).

Two factories share ``sac_region_context_fn``: ``make_selective_checkpoint_context_fn`` here (nemo_ac's policy, the
profiler-op ignore installed; ``apply_ac`` builds each block's region the same way and installs the ignore where the
plan switches it on) and ``nemo_ac.compat.selective_checkpoint_context_fn`` (another trainer's policy; its
``compat.install()`` installs the ignore). Neither has a switch to leave the fix out: the un-fixed context that shows
torch's failure is a test helper (``tests/factories.py``).

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
from nemo_ac.distributed.activation_checkpointing.policy import PolicyRules, SelectiveChoices, SelectivePolicy
from nemo_ac.workarounds.compiled_regions_under_sac import is_compiled_region
from nemo_ac.workarounds.fsdp_hooks_in_sac import fsdp_hook_running, reset_fsdp_hook_state
from nemo_ac.workarounds.profiler_ops_in_sac import ensure_profiler_ops_sac_ignored, profiler_ops_sac_ignored
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
    policy: PolicyFn | Sequence[Any], *, region: str = ""
) -> tuple[AbstractContextManager, AbstractContextManager]:
    """torch's SAC mode pair for ``policy`` (a policy function or a list of ops to save, as
    ``create_selective_checkpoint_contexts`` takes), as nemo_ac's region modes (see the module docstring). A storage
    error names ``region`` and says whether the profiler-op ignore was in force when it happened."""

    def explain(exc: RuntimeError) -> BaseException | None:
        return explain_sac_desync(
            exc, region=region, torch_version=torch.__version__, workarounds=profiler_ops_sac_ignored()
        )

    return passthrough_sac_modes(
        policy,
        passes_through=_passes_through,
        on_region_start=reset_fsdp_hook_state,
        explain_storage_error=explain,
        respect_saved_tensors_hooks=SAC_CACHE_THROUGH_SAVED_TENSORS_HOOKS,
    )


def sac_region_context_fn(policy_factory: Callable[[], PolicyFn | Sequence[Any]], *, region: str) -> ContextFn:
    """``context_fn() -> (caching mode, cached mode)`` for one region, with a fresh policy from ``policy_factory``
    per region invocation (a stateful policy's counters restart in every region, so forward and recompute agree).

    The building block both factories share (this module's for nemo_ac's blocks, ``nemo_ac.compat``'s for other
    trainers). It installs nothing process-wide: the profiler-op ignore is the caller's (``apply_ac`` as the plan
    says, ``make_selective_checkpoint_context_fn``, ``compat.install()``).
    """

    def context_fn() -> tuple[AbstractContextManager, AbstractContextManager]:
        return selective_region_modes(policy_factory(), region=region)

    return context_fn


def selective_policy_factory(config: SelectiveChoices | None = None, *, region: str = "") -> Callable[[], PolicyFn]:
    """nemo_ac's policy (``SelectiveACConfig`` defaults when ``config`` is None; the plan's ``SelectiveACPlan`` in a
    run), a fresh ``SelectivePolicy`` per call; ``NEMO_AC_SAC_DEBUG`` is read once, here."""
    rules = PolicyRules.build(config if config is not None else SelectiveACConfig())
    log = DecisionLog.from_env()

    def factory() -> PolicyFn:
        return SelectivePolicy(rules=rules, region=region, log=log)

    return factory


def make_selective_checkpoint_context_fn(*, config: SelectiveChoices | None = None, region: str = "") -> ContextFn:
    """nemo_ac's SAC context factory: nemo_ac's policy from ``config`` in nemo_ac's region modes, with the
    profiler-op ignore installed where the gate says (``workarounds.profiler_ops_in_sac``: idempotent, process-wide).
    ``region`` names the block in ``SACDesyncError``.

    Other trainers use ``nemo_ac.compat.selective_checkpoint_context_fn`` (their own policy; ``compat.install()``
    installs the ignore). The FSDP-hook brackets go on the model after fully_shard (``parallelize``).
    """
    ensure_profiler_ops_sac_ignored()
    return sac_region_context_fn(selective_policy_factory(config, region=region), region=region)
