"""Explain selective-activation-checkpointing desyncs, and log SAC policy decisions on request.

torch's SAC error names only the op and its invocation index::

    RuntimeError: profiler._record_function_enter_new.default invocation index 2 encountered during backward but
    not found in storage. This can happen if the operations in the checkpointed region are nondeterministic or
    depend on global state that changed between forward and backward.

That says nothing about which block recomputed, whether the op belongs to the model at all, or what to change.
``explain_sac_desync`` turns it into a ``SACDesyncError`` (a RuntimeError, with the torch error as
``__cause__`` and its text kept) that adds the region (block) name, the torch version, the op's origin (profiler,
FSDP parameter management, a collective, or model code) and the remedy. The nemo_ac SAC modes raise it from
inside the recompute, so it reaches ``loss.backward()`` with the block name attached.

``NEMO_AC_SAC_DEBUG=1`` logs each policy decision once per (op, decision) per process, with the reason.

This module imports nothing from nemo_ac.distributed / trainer (diagnostics are used by them, not the reverse).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from dataclasses import dataclass

SAC_DEBUG_ENV = "NEMO_AC_SAC_DEBUG"

_STORAGE_ERROR = re.compile(
    r"(?P<op>[\w.:]+) (?:invocation index (?P<index>\d+) )?encountered during backward but not found in storage"
)
# FSDP2's all-gather / reduce-scatter path: its own ops and the collectives it issues.
_FSDP_OPS = ("fsdp.", "c10d._allgather_base_", "c10d.allgather_", "c10d._reduce_scatter_base_", "c10d.reduce_scatter_")
# aten ops FSDP2's all-gather copy-in / copy-out emit too (ambiguous: the model may emit them as well).
_FSDP_SHARED_ATEN = ("aten.empty.memory_format", "aten.split_with_sizes_copy", "aten.copy_", "aten.chunk_cat")


@dataclass(frozen=True)
class OpOrigin:
    kind: str  # "profiler" | "fsdp" | "fsdp_or_model" | "collective" | "model"
    description: str


def classify_op(op_name: str) -> OpOrigin:
    """Where an op in a SAC region most likely comes from, by its qualified name (``ns.op.overload``)."""
    if op_name.startswith("profiler."):
        return OpOrigin("profiler", "a profiler op (record_function around FSDP2's hooks), not model code")
    if op_name.startswith(_FSDP_OPS):
        return OpOrigin("fsdp", "an FSDP2 parameter-management op (all-gather / reduce-scatter), not model code")
    if op_name.startswith(_FSDP_SHARED_ATEN):
        return OpOrigin(
            "fsdp_or_model",
            "an aten op FSDP2's all-gather copy-in/copy-out also emits (FSDP hooks inside the region), or model code",
        )
    if op_name.startswith(("_c10d_functional", "c10d.", "_dtensor.")):
        return OpOrigin("collective", "a collective issued inside the region (expert/context parallel)")
    return OpOrigin("model", "a model op")


def _remedy(origin: OpOrigin, *, workarounds: bool) -> str:
    if origin.kind in ("profiler", "fsdp", "fsdp_or_model") and not workarounds:
        return (
            "set activation_checkpointing.workarounds: true (ignores the profiler ops and runs FSDP2's hooks "
            "outside the SAC modes; in your own trainer: nemo_ac.compat.install() and compat.protect_fsdp_units), "
            "or use activation_checkpointing.mode: full"
        )
    if origin.kind == "profiler":
        return (
            "the profiler ops were not ignored: call nemo_ac.compat.install() (or nemo_ac.workarounds."
            "profiler_ops_in_sac.ensure_profiler_ops_sac_ignored()) before the first forward (the nemo_ac SAC factories do), or use "
            "activation_checkpointing.mode: full"
        )
    if origin.kind in ("fsdp", "fsdp_or_model"):
        return (
            "FSDP2's hooks ran inside the SAC modes: call nemo_ac.compat.protect_fsdp_units(model) (nemo_ac."
            "workarounds.fsdp_hooks_in_sac.install_fsdp_hooks_outside_sac) after fully_shard (nemo_ac.distributed.parallelize "
            "does), or set parallel.fsdp.forward_prefetch: none and backward_prefetch: default"
        )
    if origin.kind == "collective":
        return (
            "a collective ran a different number of times in recompute: keep collectives saved "
            "(activation_checkpointing.selective.save_communication: true) and make dispatch depend only on saved "
            "router outputs"
        )
    return (
        "the region's op stream changed between forward and recompute: data-dependent control flow (e.g. expert "
        "counts from a router that recomputed differently; keep activation_checkpointing.selective.save_router: "
        "true), global state changed between forward and backward, or a recompute that compiled differently on the "
        "autograd thread (compile.forward_thread_context: true). Use activation_checkpointing.mode: full to confirm"
    )


def parse_sac_storage_error(exc: BaseException) -> tuple[str, int | None] | None:
    """``(op name, invocation index or None)`` if ``exc`` is torch's SAC 'not found in storage' error."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, SACDesyncError):
        return None
    match = _STORAGE_ERROR.search(str(exc))
    if match is None:
        return None
    index = match.group("index")
    return match.group("op"), int(index) if index is not None else None


class SACDesyncError(RuntimeError):
    """torch's SAC storage error plus where, why and what to do. ``__cause__`` is the original error."""

    def __init__(
        self,
        message: str,
        *,
        op: str,
        index: int | None,
        region: str,
        torch_version: str,
        origin: OpOrigin,
        remedy: str,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.index = index
        self.region = region
        self.torch_version = torch_version
        self.origin = origin
        self.remedy = remedy


def explain_sac_desync(
    exc: BaseException, *, region: str, torch_version: str, workarounds: bool
) -> SACDesyncError | None:
    """A ``SACDesyncError`` for torch's SAC storage error (raise it ``from exc``); None for any other error."""
    parsed = parse_sac_storage_error(exc)
    if parsed is None:
        return None
    op, index = parsed
    origin = classify_op(op)
    remedy = _remedy(origin, workarounds=workarounds)
    lines = [
        f"selective activation checkpointing desynced in region {region!r}:",
        f"  op: {op} (invocation index {index if index is not None else 'n/a'}) ran in the backward recompute but "
        "not in forward (or ran there a different number of times)",
        f"  origin: {origin.description}; profiler op: {origin.kind == 'profiler'}; "
        f"FSDP op: {origin.kind in ('fsdp', 'fsdp_or_model')}",
        f"  torch: {torch_version}; nemo_ac SAC workarounds: {'on' if workarounds else 'off'}",
        f"  remedy: {remedy}",
        f"  torch said: {exc}",
    ]
    return SACDesyncError(
        "\n".join(lines),
        op=op,
        index=index,
        region=region,
        torch_version=torch_version,
        origin=origin,
        remedy=remedy,
    )


# ------------------------------------------------------------------------------------------------------------
# NEMO_AC_SAC_DEBUG: each policy decision once per (op, decision)

_logger = logging.getLogger("nemo_ac.sac")
_seen: set[tuple[str, str]] = set()
_seen_lock = threading.Lock()


def sac_debug_enabled() -> bool:
    return os.environ.get(SAC_DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


class DecisionLog:
    """Logs a SAC policy decision the first time this process sees that (op, decision) pair.

    Read once per SAC context factory (not per op) so the env var costs nothing when unset. Records go to the
    ``nemo_ac.sac`` logger at INFO; when nothing is configured to show them, a stderr handler is attached so the
    env var alone is enough.
    """

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        if enabled and not _logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            _logger.addHandler(handler)
            _logger.setLevel(logging.INFO)

    @classmethod
    def from_env(cls) -> DecisionLog:
        return cls(enabled=sac_debug_enabled())

    def record(self, *, op: str, decision: str, reason: str, region: str) -> None:
        if not self.enabled:
            return
        key = (op, decision)
        with _seen_lock:
            if key in _seen:
                return
            _seen.add(key)
        rank = os.environ.get("RANK", "0")
        _logger.info("rank %s | %s -> %s (%s; first seen in %s)", rank, op, decision, reason, region or "?")


def reset_decision_log() -> None:
    """Forget which decisions were logged (tests)."""
    with _seen_lock:
        _seen.clear()
