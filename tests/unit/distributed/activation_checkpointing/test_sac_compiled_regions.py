"""Selective AC around an inductor-compiled block (ac_outer): compiled regions are one opaque, recomputed op.

Without ``wrap_inductor_compiled_regions`` the SAC modes see every op inductor's generated code dispatches and
cache references to their outputs; inductor reuses and overwrites those buffers later in the same graph, so the
recompute replays stale data. torch 2.13 catches it here through a version counter::

    RuntimeError: Tensor cached during selective activation checkpoint has been mutated

and, in the ring / ulysses CP trainer runs where no counter was bumped, it gave wrong gradients silently.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils.checkpoint import checkpoint

from nemo_ac.config.schema import SelectiveACConfig
from nemo_ac.distributed.activation_checkpointing import make_selective_checkpoint_context_fn
from nemo_ac.workarounds.compiled_regions_under_sac import ac_outer_compile_kwargs

pytestmark = [pytest.mark.workaround, pytest.mark.usefixtures("fresh_dynamo")]


def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """A collective between matmuls, whose output stays live across later buffers (as in CP attention)."""
    h = x @ w1
    y = funcol.all_to_all_single(h, None, None, dist.group.WORLD)
    z = torch.relu(y) * 2 + 1
    u = (z @ w2).sin()
    v = (u @ w3).cos() + u
    return v * y.sum()


def grads(fn, x, weights, *, checkpointed: bool):
    context_fn = make_selective_checkpoint_context_fn(config=SelectiveACConfig())
    if checkpointed:
        out = checkpoint(fn, x, *weights, use_reentrant=False, context_fn=context_fn)
    else:
        out = fn(x, *weights)
    return torch.autograd.grad(out.sum(), weights)


def test_selective_ac_over_inductor_code_replays_overwritten_buffers_without_region_wrapping(world):
    torch.manual_seed(0)
    x = torch.randn(40, 24)
    weights = [torch.randn(24, 24, requires_grad=True) for _ in range(3)]
    compiled = torch.compile(block, backend="inductor")
    with pytest.raises(RuntimeError, match="Tensor cached during selective activation checkpoint has been mutated"):
        grads(compiled, x, weights, checkpointed=True)


def test_wrapped_regions_are_recomputed_and_match_the_compiled_block_exactly(world):
    torch.manual_seed(0)
    x = torch.randn(40, 24)
    weights = [torch.randn(24, 24, requires_grad=True) for _ in range(3)]
    kwargs = ac_outer_compile_kwargs({"backend": "inductor"})
    assert kwargs["options"] == {"wrap_inductor_compiled_regions": True}
    compiled = torch.compile(block, **kwargs)
    expected = grads(compiled, x, weights, checkpointed=False)
    actual = grads(compiled, x, weights, checkpointed=True)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
