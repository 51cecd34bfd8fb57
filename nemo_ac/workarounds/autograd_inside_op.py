"""The one private-torch technique under the mixer-kernel ops' backward: run autograd inside a custom op's body.

Not a failure of its own. ``nemo_ac::fla_gated_delta_rule_backward`` and ``nemo_ac::mamba_chunk_scan_backward``
(``models.mixer_kernels``) are opaque custom ops, so that torch.compile's backward graph holds them as one node
and SAC never sees the kernels' own allocations. Their body reaches the kernels' backward through the kernels' public
entry points, which are ``torch.autograd.Function`` s (fla and mamba-ssm expose their backward only that way): it
re-runs the kernel forward on detached inputs with grad enabled and calls ``torch.autograd.grad``. torch runs a
custom op's body under ``_AutoDispatchBelowAutograd`` (``torch/_library/autograd.py``), which excludes the autograd
dispatch keys for everything called inside, so ``torch.enable_grad()`` alone records nothing and the grad call fails
with::

    RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn

``autograd_inside_op`` lifts exactly that exclusion for the block (``torch._C._ForceDispatchKeyGuard`` with the
current include set and the exclude set minus the autograd keys) and restores the thread's sets on exit.
Relies on: torch._C._ForceDispatchKeyGuard and the thread's dispatch key sets (lifting the autograd exclusion torch
sets around a custom op's body).
Torch versions: checked on 2.13 eagerly, under aot_eager and under inductor
(``tests/unit/models/kernels/test_mixer_kernels.py``); nemo_ac supports 2.12 - 2.15 (``workarounds.gates``); ``nemo-ac
doctor`` (check ``autograd_inside_op``) runs a custom op whose body needs it, without and with it, on the installed
torch. Upstream: none filed.
Delete when: the kernels' backward is called directly (fla's ``chunk_gated_delta_rule_bwd``, mamba-ssm's
``_mamba_chunk_scan_combined_bwd``: private, version-specific signatures), or when torch.library offers a public way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_AUTOGRAD_KEYS = ("AutogradFunctionality", "ADInplaceOrView", "AutogradOther", "AutogradNestedTensor")


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Inside a custom op's body: let the ops in this block record autograd (grad mode on)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    include = torch._C._dispatch_tls_local_include_set()
    for name in _AUTOGRAD_KEYS:
        key = getattr(torch._C.DispatchKey, name, None)
        if key is not None:
            exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield
