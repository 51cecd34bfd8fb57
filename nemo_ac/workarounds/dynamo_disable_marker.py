"""Whether a function was wrapped by ``torch.compiler.disable``: read from the private marker Dynamo leaves on it.

Not a failure of its own: the plan (``distributed.untraceable``) must know, before anything runs, which modules of a
block Dynamo will not trace (Transformer Engine's ``no_torch_dynamo`` is ``torch._dynamo.disable``), because under
compile(AC(block)) one such call makes Dynamo run the whole checkpointed block eagerly, silently. torch offers no
public query; ``torch.compiler.disable`` / ``torch._dynamo.disable`` set the attribute ``_torchdynamo_disable`` to
True on the wrapper they return (``torch/_dynamo/eval_frame.py``, ``DisableContext``).

Relies on: the _torchdynamo_disable attribute of a Dynamo-disabled wrapper.
Torch versions: checked on 2.13.0 (this tree's tests, ``nemo-ac doctor`` check ``dynamo_disable_marker``); nemo_ac
supports 2.12 - 2.15 (``workarounds.gates``). Where the marker disappears this returns False for every function: the
plan then stops seeing such modules (the run's compile report still counts their graph breaks).
Upstream: none filed.
Delete when: torch offers a public ``is_disabled`` query (then call it here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MARKER = "_torchdynamo_disable"


def is_dynamo_disabled(fn: Callable[..., Any] | None) -> bool:
    """Whether ``fn`` (a function or bound method) was wrapped by ``torch.compiler.disable``."""
    return bool(getattr(fn, _MARKER, False))
