"""NeMo Automodel interop (extra ``automodel``): Automodel's selective AC with nemo_ac's forward-thread context.

Automodel builds its SAC regions with
``nemo_automodel.components.distributed.activation_checkpointing.make_selective_checkpoint_context_fn()`` (a
factory returning torch's caching/cached mode pair per region; it ignores the profiler and FSDP ops itself). It
has no answer to the per-thread Dynamo config of torch >= 2.12: when a recompute of a region holding a compiled
module runs on another thread (the autograd device thread on GPU) and misses the forward's cache entry, it
compiles with that thread's defaults and the backward fails with ``CheckpointError: ... Recomputed values for the
following tensors have different metadata than during the forward pass``. ``automodel_selective_context_fn()``
wraps Automodel's factory with ``forward_thread_compile_context``; ``add_recompute_context(model)`` does the same
for blocks Automodel's parallelizer has already wrapped.

nemo-automodel is imported only when a function here is called, never by ``import nemo_ac``.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from nemo_ac.compat.regions import ContextFn, with_forward_thread_compile_context

AUTOMODEL_AC_MODULE = "nemo_automodel.components.distributed.activation_checkpointing"
INSTALL_HINT = "pip install 'nemo_ac[automodel]'"


def automodel_available() -> bool:
    """True when nemo-automodel is importable (its selective AC module is what the helpers use)."""
    try:
        return importlib.util.find_spec("nemo_automodel") is not None
    except (ImportError, ValueError):
        return False


def automodel_ac_module() -> ModuleType:
    """Automodel's activation-checkpointing module, or ImportError with the install line."""
    try:
        return importlib.import_module(AUTOMODEL_AC_MODULE)
    except ImportError as exc:
        raise ImportError(f"NeMo Automodel is not importable ({exc}); {INSTALL_HINT}") from exc


def automodel_selective_context_fn(automodel_context_fn: ContextFn | None = None) -> ContextFn:
    """Automodel's SAC ``context_fn`` with the forward thread's compile settings re-applied in its recompute.

    automodel_context_fn: a context factory Automodel built (default: a new one from its
        ``make_selective_checkpoint_context_fn()``, which, like Automodel itself, adds the profiler and FSDP ops to
        ``SAC_IGNORED_OPS`` when called).
    Use it where Automodel takes a ``context_fn`` (``checkpoint_wrapper(block, context_fn=...)``).
    """
    if automodel_context_fn is None:
        automodel_context_fn = automodel_ac_module().make_selective_checkpoint_context_fn()
    return with_forward_thread_compile_context(automodel_context_fn)
