"""What both mixer-kernel ops share: document boundaries as the kernels take them, and the backward by re-run.

Why a backward by re-run: fla and mamba-ssm expose their backward only through the ``torch.autograd.Function`` behind
their public entry points (their ``*_fwd`` / ``*_bwd`` helpers are private, with signatures that change between
releases). The backward op therefore runs the kernel forward once more on the saved inputs, with autograd on, and asks
autograd for the input gradients: the kernels' own backward runs, preceded by one extra kernel forward. The op saves
its inputs, not the kernel's intermediates, so between forward and backward it holds what the torch op's inputs hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nemo_ac.workarounds.autograd_inside_op import autograd_inside_op


def document_runs(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] -> [B, S] int32 index of the run of equal ids each token is in, counted over the flattened batch (so
    runs of different rows never share an index): mamba-ssm's ``seq_idx`` after a reshape to one row, and the
    same isolation the torch ops give (a run of padding ids is a document of its own)."""
    change = torch.ones_like(document_ids, dtype=torch.int32)
    if document_ids.shape[1] > 1:
        change[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).to(torch.int32)
    return torch.cumsum(change.reshape(-1), dim=0).reshape(document_ids.shape).to(torch.int32) - 1


def cu_seqlens_of(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids -> [N + 1] int64 cumulative lengths of the N runs over the flattened batch (fla's
    ``cu_seqlens`` for [1, B*S, ...] inputs). Data dependent (one nonzero), so only called inside an op's body."""
    flat = document_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts = starts.reshape(document_ids.shape)
    starts[:, 0] = True  # every row starts a run, even when the previous row ended with the same id
    idx = torch.nonzero(starts.reshape(-1)).flatten()
    return torch.cat((idx, idx.new_tensor([flat.numel()]))).to(torch.int64)


def grads_by_rerun(
    forward: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], grad_out: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Input gradients of ``forward(*inputs)`` for ``grad_out``, from inside a custom op's body: re-runs ``forward``
    on detached copies with autograd on (the kernels' own backward runs in ``torch.autograd.grad``). Inputs that
    get no gradient (not floating point, or unused) get zeros, since an op returns tensors only; every gradient is
    contiguous (the backward ops' fake impls promise that layout)."""
    with autograd_inside_op():
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        out = forward(*leaves)
        wanted = [t for t in leaves if t.requires_grad]
        grads = torch.autograd.grad(out, wanted, grad_out, allow_unused=True)
    by_leaf = dict(zip(map(id, wanted), grads))
    result = []
    for t in leaves:
        g = by_leaf.get(id(t))
        # Contiguous, as the fake impls say: compiled backward graphs view them by that layout.
        result.append(t.new_zeros(t.shape) if g is None else g.to(t.dtype).contiguous())
    return tuple(result)
