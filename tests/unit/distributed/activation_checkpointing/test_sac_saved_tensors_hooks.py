"""torch 2.14's ``respect_saved_tensors_hooks``: nemo_ac chooses it on every SAC region instead of leaving it open.

torch 2.14 and 2.15 warn when a selective checkpoint region runs under a ``saved_tensors_hooks`` context and the
caller left the choice at None (``FutureWarning: A saved_tensors_hooks context (e.g. save_on_cpu) is active around a
selective activation checkpoint region ...``); the next release raises. nemo_ac keeps SAC's cache out of the hooks
(``SAC_CACHE_THROUGH_SAVED_TENSORS_HOOKS = False``) both for a block with only the SAC modes (torch hands the
checkpoint's kwarg to the mode) and for composed contexts (SAC + forward-thread compile context: torch cannot see the
mode, so it carries the choice itself). torch's own SAC modes, without the choice, are the control: they warn.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nemo_ac.distributed.activation_checkpointing import make_selective_checkpoint_context_fn, wrap_block
from nemo_ac.distributed.activation_checkpointing.contexts import SAC_CACHE_THROUGH_SAVED_TENSORS_HOOKS
from nemo_ac.distributed.activation_checkpointing.wrapping import checkpoint_kwargs
from nemo_ac.workarounds.forward_thread_compile_config import forward_thread_compile_context
from nemo_ac.workarounds.sac_mode_passthrough import checkpoint_takes_saved_tensors_hooks_choice

CHOICE = checkpoint_takes_saved_tensors_hooks_choice()
needs_choice = pytest.mark.skipif(not CHOICE, reason="this torch's checkpoint has no respect_saved_tensors_hooks")
WARNING = r"respect_saved_tensors_hooks=True\|False"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 12)
        self.b = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _under_hooks(run) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Forward under a spy ``saved_tensors_hooks`` (as a memory accounting or an offloader), backward outside it."""
    packed: list[torch.Tensor] = []
    x = torch.randn(5, 12, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = run(x)
    out.square().sum().backward()
    return packed, x.grad


def test_checkpoint_kwargs_state_the_choice_where_torch_takes_it():
    expected = {"use_reentrant": False}
    if CHOICE:
        expected["respect_saved_tensors_hooks"] = SAC_CACHE_THROUGH_SAVED_TENSORS_HOOKS
    assert checkpoint_kwargs() == expected


@needs_choice
def test_torch_sac_without_the_choice_warns_under_saved_tensor_hooks():
    """The control: what every nemo_ac SAC region would do without its explicit choice."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    with pytest.warns(FutureWarning, match=WARNING):
        _under_hooks(lambda x: checkpoint(Block(), x, use_reentrant=False, context_fn=context_fn))


@needs_choice
@pytest.mark.parametrize("composed", [False, True], ids=["sac_only", "sac_and_compile_context"])
def test_nemo_ac_sac_regions_choose_and_keep_the_cache_out_of_the_hooks(composed):
    sac = make_selective_checkpoint_context_fn(region="block")
    contexts = [sac, forward_thread_compile_context] if composed else [sac]
    block = wrap_block(Block(), context_fns=contexts)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        packed, grad = _under_hooks(block)
    reference, reference_grad = _under_hooks(Block())
    assert torch.equal(grad, reference_grad)
    # Legacy semantics kept: the hooks see fewer tensors than without AC (SAC's cached matmul outputs bypass them).
    assert 0 < len(packed) < len(reference)
