"""The forward-thread compile context: the torch behaviour it relies on, and the SAC failure it prevents.

Backward runs on a worker thread that sets another intra-op thread count: ``num_threads`` is part of Dynamo's
global-state guard, so the recompute misses the forward's cache entry and compiles on that thread, as the CUDA
autograd device thread does. The compiles use backend ``aot_eager``: the failure lives in Dynamo's per-thread config
and cache (before any backend runs) and needs more than 8 compiles of one frame; aot_eager still runs AOTAutograd
and its partitioner, and keeps those 20 compiles to seconds (inductor would need minutes on a CI core).
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nemo_ac.diagnostics.recompiles import CompileAccounting, EagerFallbackWarning
from nemo_ac.distributed.activation_checkpointing import compose_context_fns
from nemo_ac.distributed.compile import CompileSettings, use_compile_settings
from nemo_ac.doctor.isolation import on_thread, other_num_threads
from nemo_ac.workarounds.forward_thread_compile_config import (
    apply_thread_compile_config,
    capture_thread_compile_config,
    forward_thread_compile_context,
)

DEFAULT_LIMIT = 8  # torch._dynamo.config.recompile_limit's default (2.12 - 2.13)
SAC_REPLAY_FAILURE = re.compile(r"Recomputed values for the following tensors|not found in storage")


pytestmark = [pytest.mark.workaround, pytest.mark.usefixtures("fresh_dynamo")]


def test_a_new_thread_sees_dynamo_defaults_after_the_main_thread_changed_them():
    """torch >= 2.12: Dynamo / compiler config is per thread (ContextVar); a new thread starts from the defaults."""
    with (
        torch._dynamo.config.patch(recompile_limit=64, capture_scalar_outputs=True),
        torch.compiler.config.patch(dynamic_sources="L['x']"),
    ):
        assert torch._dynamo.config.recompile_limit == 64
        seen = on_thread(
            lambda: (
                torch._dynamo.config.recompile_limit,
                torch._dynamo.config.capture_scalar_outputs,
                torch.compiler.config.dynamic_sources,
            )
        )
    assert seen == (DEFAULT_LIMIT, False, "")


def test_captured_settings_apply_on_another_thread_and_are_restored():
    with (
        torch._dynamo.config.patch(recompile_limit=48, skip_fwd_side_effects_in_bwd_under_checkpoint=True),
        torch.compiler.config.patch(dynamic_sources="L['y']"),
    ):
        captured = capture_thread_compile_config()

    def inside_and_after():
        with apply_thread_compile_config(captured):
            inside = (
                torch._dynamo.config.recompile_limit,
                torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint,
                torch.compiler.config.dynamic_sources,
            )
        return inside, torch._dynamo.config.recompile_limit

    inside, after = on_thread(inside_and_after)
    assert inside == (48, True, "L['y']")
    assert after == DEFAULT_LIMIT
    assert torch._dynamo.config.recompile_limit == DEFAULT_LIMIT  # the capture changed nothing on this thread


def test_nemo_settings_merge_with_the_threads_own_dynamic_sources():
    settings = CompileSettings(recompile_limit=32, capture_scalar_outputs=True, dynamic_sources="L['a'],L['b']")
    with torch.compiler.config.patch(dynamic_sources="L['user']"), use_compile_settings(settings):
        assert torch.compiler.config.dynamic_sources == "L['user'],L['a'],L['b']"
        assert torch._dynamo.config.recompile_limit == 32
    assert torch._dynamo.config.recompile_limit == DEFAULT_LIMIT


def test_context_under_compile_is_plain_ac():
    """compile(checkpoint(f, context_fn=forward_thread_compile_context)): under tracing the context must be a
    TorchDispatchMode pair (null contexts fail, asserted below) and it then equals Dynamo's plain AC."""

    def f(x, w):
        return torch.tanh(torch.tanh(x @ w) @ w)

    def null_context_fn():
        return contextlib.nullcontext(), contextlib.nullcontext()

    x, w = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    expected = torch.autograd.grad(f(x, w).sum(), (x, w))

    ours = torch.compile(
        lambda x, w: checkpoint(f, x, w, use_reentrant=False, context_fn=forward_thread_compile_context),
        backend="aot_eager",
    )
    got = torch.autograd.grad(ours(x, w).sum(), (x, w))
    torch.testing.assert_close(got, expected)

    torch._dynamo.reset()
    nulls = torch.compile(
        lambda x, w: checkpoint(f, x, w, use_reentrant=False, context_fn=null_context_fn), backend="aot_eager"
    )
    with pytest.raises(Exception, match="must generate a tuple of two `TorchDispatchMode`s"):
        nulls(x, w)


# ------------------------------------------------------------------------------------------------------------
# the regression: AC(compile(block)) with SAC, recompute on another thread, > 8 shapes


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).sin()


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def sac_context():
    return create_selective_checkpoint_contexts(save_matmuls)


def train_shapes(*, forward_thread_context: bool, shapes: range) -> CompileAccounting:
    """AC(compile(block)) under SAC: forward on this thread with nemo_ac's settings (recompile_limit 64, as the
    scoped outer forward applies them), backward on a worker thread that misses the cache. ``dynamic=False`` and a
    new row count per step: every shape compiles on both threads."""
    torch.manual_seed(0)
    block = Block()
    block.forward = torch.compile(block.forward, backend="aot_eager", dynamic=False)
    fns = [sac_context, forward_thread_compile_context] if forward_thread_context else [sac_context]
    context_fn = compose_context_fns(fns)
    settings = CompileSettings(recompile_limit=64, capture_scalar_outputs=True, dynamic_sources="")
    main_threads = torch.get_num_threads()
    with CompileAccounting() as accounting:
        for rows in shapes:
            x = torch.randn(rows, 16, requires_grad=True)
            with use_compile_settings(settings):
                out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
            on_thread(lambda out=out: out.sum().backward(), num_threads=other_num_threads())
            assert x.grad is not None and x.grad.shape == (rows, 16)
        accounting.refresh()
    assert torch.get_num_threads() == main_threads
    return accounting


def test_without_the_forward_thread_context_the_recompute_hits_the_default_limit_and_sac_replay_fails():
    """Documents the failure: the worker thread compiles with recompile_limit 8; once the frame has 8 entries the
    recompute runs eagerly while the forward ran compiled, and the SAC replay fails. CompileAccounting warns."""
    with (
        pytest.warns(EagerFallbackWarning, match=r"on the bwd thread: 'forward'.*recompile_limit=8"),
        pytest.raises(Exception, match=SAC_REPLAY_FAILURE),
    ):
        train_shapes(forward_thread_context=False, shapes=range(3, 3 + 2 * DEFAULT_LIMIT))


def test_with_the_forward_thread_context_the_recompute_compiles_once_per_shape_on_the_worker_thread():
    shapes = range(3, 3 + DEFAULT_LIMIT + 2)  # 10 shapes: 20 cache entries, well past the default limit
    accounting = train_shapes(forward_thread_context=True, shapes=shapes)
    n = len(shapes)
    assert counters["stats"]["unique_graphs"] == 2 * n  # one forward graph + one recompute graph per shape
    m = accounting.metrics()
    assert (m["compiles_fwd"], m["compiles_bwd"], m["eager_fallbacks"]) == (n, n, 0)
    # Every recompute compile is a recompile forced by the thread's global state, none by a config difference.
    reasons = accounting.threads["bwd"].reasons
    assert sum(reasons.values()) == n and all("num_threads" in r for r in reasons)
