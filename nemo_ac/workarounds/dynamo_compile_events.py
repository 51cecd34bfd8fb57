"""The private Dynamo hooks nemo_ac's compile diagnostics read: per-compile callbacks, counters, compile metrics.

Not a failure of its own: torch has no public per-compile hook (``torch.compiler`` offers none and ``torch._logging``
only logs), so the per-thread compile accounting (``diagnostics.recompiles``) and the compile progress lines
(``diagnostics.compile_progress``) stand on three private pieces, each behind one function below:

- ``torch._dynamo.callback_handler`` (``torch/_dynamo/callback.py``, a ``CompilationCallbackHandler``):
  ``register_start_callback`` / ``register_end_callback`` and their ``remove_*`` twins; the callbacks run on the
  compiling thread for every Dynamo frame compile and every lazily compiled AOTAutograd backward graph, with a
  ``CallbackArgs`` carrying ``callback_trigger`` and ``compile_id``.
- ``torch._dynamo.utils.counters`` (a dict of ``Counter`` s): the ``"graph_break"`` counter grows by one per break.
- ``torch._dynamo.utils.get_compilation_metrics()``: one record per compile with ``compile_id`` and
  ``recompile_reason``.

Relies on: torch._dynamo.callback_handler, torch._dynamo.utils.counters, torch._dynamo.utils.get_compilation_metrics.
Torch versions: checked on 2.13.0 (this tree's tests, ``nemo-ac doctor``); nemo_ac supports 2.12 - 2.15 (the gate
table, ``workarounds.gates``) and every function here is defensive: where a piece is missing the diagnostics report
nothing (and say so) instead of failing the run. ``nemo-ac doctor`` checks each piece on the installed torch (check
``dynamo_compile_events``).
Upstream: none filed.
Delete when: torch offers a public per-compile start/end hook and compile metrics (then call those here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


def _dynamo() -> Any:
    import torch._dynamo

    return torch._dynamo


def compile_callback_handler() -> Any | None:
    """``torch._dynamo.callback_handler``, or None where this torch has none (or one without the register API)."""
    handler = getattr(_dynamo(), "callback_handler", None)
    if handler is None or not hasattr(handler, "register_start_callback"):
        return None
    return handler


def add_compile_callbacks(on_start: Callable[..., Any], on_end: Callable[..., Any]) -> Any | None:
    """Register a start / end callback pair on Dynamo's callback handler; returns the handler for
    ``remove_compile_callbacks`` (None where torch has none: nothing is registered)."""
    handler = compile_callback_handler()
    if handler is not None:
        handler.register_start_callback(on_start)
        handler.register_end_callback(on_end)
    return handler


def remove_compile_callbacks(handler: Any | None, on_start: Callable[..., Any], on_end: Callable[..., Any]) -> None:
    """Undo ``add_compile_callbacks`` (a callback already gone is not an error)."""
    if handler is None:
        return
    for remove, callback in ((handler.remove_start_callback, on_start), (handler.remove_end_callback, on_end)):
        with contextlib.suppress(ValueError):
            remove(callback)


def graph_break_total() -> int:
    """Graph breaks Dynamo has counted in this process (0 where the counter is missing)."""
    try:
        return int(sum(_dynamo().utils.counters["graph_break"].values()))
    except Exception:
        return 0


def compilation_metrics() -> list[Any]:
    """Dynamo's per-compile records (``compile_id``, ``recompile_reason``, ...); [] where missing."""
    try:
        return list(_dynamo().utils.get_compilation_metrics())
    except Exception:
        return []


def clear_dynamo_counters() -> None:
    """Empty Dynamo's process-wide counters (``torch.compiler.reset()`` leaves them), so a count starts at 0."""
    with contextlib.suppress(Exception):
        _dynamo().utils.counters.clear()
