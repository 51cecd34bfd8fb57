"""FSDP2's ``record_function`` profiler ops inside a selective-AC region.

Error prevented (torch >= 2.13, an FSDP2 unit inside a SAC region: experts or an fp32 router sharded on their own
inside a checkpointed block, or the block itself with ``activation_checkpointing.placement: outside``)::

    RuntimeError: profiler._record_function_enter_new.default invocation index 2 encountered during backward
    but not found in storage. This can happen if the operations in the checkpointed region are nondeterministic or
    depend on global state that changed between forward and backward.

Why: FSDP2 runs its hooks under ``torch.profiler.record_function``, which dispatches
``profiler._record_function_enter / _enter_new / _exit``. A nested unit whose pre-backward hook has not fired yet
when its block recomputes runs its full pre/post-forward in the recompute, with another number of those ops than
in forward. From torch 2.13 on, SAC's recompute mode looks every op up by (op, invocation index) in what the forward
stored and no longer asks the policy, so the counters disagree. torch 2.12.1's recompute asked the policy again and
ran every op it did not save: the same extra ops were harmless there (``nemo-ac doctor`` on 2.12.1: not affected),
hence the gate from 2.13.

Fix: every overload of the three ops goes into ``torch.utils.checkpoint.SAC_IGNORED_OPS`` (a module-level set torch's
SAC modes read per op): ignored ops run normally in both passes and are never counted, which is right for ops that
only push and pop profiler ranges. This helps any SAC policy, torch's own ``create_selective_checkpoint_contexts``
included. Called from the SAC context factories and ``nemo_ac.compat.install()``, never at import time.

Upstream: pytorch/pytorch#185178 (adds the same ignore; closed unmerged), pytorch/pytorch#196862 (FSDP all-gather
internals and profiler ops bypass SAC; closed unmerged); reported against torchtitan as pytorch/torchtitan#3427.
Delete when: a torch release lists the profiler ops in ``SAC_IGNORED_OPS`` itself (``nemo-ac doctor`` row
``upstream_profiler_ignore`` turns "fixed upstream"); set ``until`` in ``gates.GATES["profiler_ops_in_sac"]``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint

from nemo_ac.workarounds.gates import gate_active

# The three profiler ops FSDP2's ``record_function`` dispatches on torch 2.13 (all overloads are added).
PROFILER_NAMESPACE = "profiler"
PROFILER_OP_NAMES = ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")


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


def sac_ignored_ops() -> set[Any] | None:
    """torch's ``SAC_IGNORED_OPS`` set, or None on a torch without one."""
    ignored = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", None)
    return ignored if isinstance(ignored, set) else None


def ensure_profiler_ops_sac_ignored(*, torch_version: str | None = None) -> tuple[Any, ...]:
    """Add the profiler ops to ``torch.utils.checkpoint.SAC_IGNORED_OPS``; returns the ops it added.

    Idempotent; a no-op outside the gate (``torch_version`` overrides the running version, for the doctor and
    tests), when the set or the ops do not exist, or when upstream already ignores them. Mutates torch's
    module-level set on purpose: the checkpoint modes read it per op.
    """
    if not gate_active("profiler_ops_in_sac", torch_version=torch_version):
        return ()
    ignored = sac_ignored_ops()
    if ignored is None:
        return ()
    added = tuple(op for op in profiler_op_overloads() if op not in ignored)
    ignored.update(added)
    return added


def profiler_ops_sac_ignored() -> bool:
    """Whether every profiler-op overload is in ``SAC_IGNORED_OPS`` now (by nemo_ac, upstream or anyone): what a
    SAC desync explanation reports as "workarounds on"."""
    ignored = sac_ignored_ops()
    overloads = profiler_op_overloads()
    return ignored is not None and bool(overloads) and all(op in ignored for op in overloads)


# torch's own ignore set as this process found it when nemo_ac was imported (read, never written), so that an
# upstream fix can be told apart from nemo_ac's own addition (``nemo-ac doctor``, ``nemo_ac.compat.status``).
_IGNORED_AT_IMPORT = frozenset(sac_ignored_ops() or ())


def profiler_ops_ignored_upstream() -> bool:
    """True when every profiler-op overload was already in ``SAC_IGNORED_OPS`` before nemo_ac touched it (a torch
    that fixed the desync itself, or another library that applied the same ignore first)."""
    overloads = profiler_op_overloads()
    return bool(overloads) and all(op in _IGNORED_AT_IMPORT for op in overloads)
