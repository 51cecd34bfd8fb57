"""Reading and patching the two Dynamo settings nemo_ac's compiled blocks need, which only Dynamo's private config
module holds.

Not a failure of its own: ``recompile_limit`` (packed variable-length batches exceed the default 8 long before shapes
settle) and ``capture_scalar_outputs`` (the experts loop's ``tokens_per_expert.tolist()`` traced into unbacked
symints instead of a graph break) exist only in ``torch._dynamo.config``; ``torch.compiler.config`` (public) holds
neither. nemo_ac never writes them globally: ``dynamo_settings_patched`` sets them on the calling thread for a scope
(every key is a ``ContextVar`` since torch 2.12, see ``forward_thread_compile_config``) and restores them.

Relies on: torch._dynamo.config.recompile_limit and torch._dynamo.config.capture_scalar_outputs (their names and
their per-thread behaviour).
Torch versions: checked on 2.13.0 (this tree's tests, ``nemo-ac doctor`` check ``dynamo_settings``); nemo_ac
supports 2.12 - 2.15 (``workarounds.gates``). ``torch.compile(..., recompile_limit=...)`` (where torch takes it,
``distributed.compile.apply``) covers the first key on every thread.
Upstream: none filed.
Delete when: both settings are public (``torch.compiler.config`` or ``torch.compile`` arguments); then read and
patch them there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from nemo_ac.workarounds.forward_thread_compile_config import patched_config

# The Dynamo settings nemo_ac reads or patches (anything else stays torch's).
DYNAMO_SETTINGS = ("recompile_limit", "capture_scalar_outputs")


def _dynamo_config() -> ModuleType:
    import torch._dynamo.config

    return torch._dynamo.config


def dynamo_setting(key: str) -> Any:
    """The calling thread's value of one of ``DYNAMO_SETTINGS``."""
    if key not in DYNAMO_SETTINGS:
        raise KeyError(f"nemo_ac reads only the Dynamo settings {DYNAMO_SETTINGS}, not {key!r}")
    return getattr(_dynamo_config(), key)


@contextlib.contextmanager
def dynamo_settings_patched(changes: Mapping[str, Any]) -> Iterator[None]:
    """Set ``changes`` (keys of ``DYNAMO_SETTINGS``) on the calling thread for the scope, then restore; keys already
    at their value are left alone."""
    unknown = set(changes) - set(DYNAMO_SETTINGS)
    if unknown:
        raise KeyError(f"nemo_ac patches only the Dynamo settings {DYNAMO_SETTINGS}, not {sorted(unknown)}")
    config = _dynamo_config()
    differing = {key: value for key, value in changes.items() if getattr(config, key) != value}
    with patched_config(config, differing):
        yield
