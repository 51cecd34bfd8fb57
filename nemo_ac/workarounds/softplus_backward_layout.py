"""``F.softplus`` under ``torch.compile`` when its gradient arrives as a transposed view (Gated DeltaNet's decay).

Error prevented (torch 2.13, aot_eager and AOT-based backends, a compiled Qwen3.5/3.6 Gated DeltaNet block)::

    RuntimeError: view size is not compatible with input tensor's size and stride ...

Why: the backward graph assumes a contiguous ``softplus_backward`` output, but the gradient reaching the decay is a
transposed view (the chunked rule works in [B, H, S] layout), so the following ``view`` fails.

Fix: ``softplus`` written with elementwise primitives: the same values and gradient (sigmoid) as ``F.softplus``
(beta 1, threshold 20), and no ``softplus_backward`` node. Used on every release (it costs nothing).

Upstream: none filed yet. Delete when: a compiled Gated DeltaNet block with ``F.softplus`` passes
``tests/unit/models/layers/test_models_qwen3_5_gated_deltanet.py`` on every supported torch.
"""

from __future__ import annotations

import torch


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``F.softplus(x)`` (beta 1, threshold 20) with elementwise primitives (see the module docstring)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))
