"""Per-thread compile config probes: what a backward recompute on another thread sees, and what it breaks.

Since torch 2.12 every key of ``torch._dynamo.config`` / ``torch.compiler.config`` is a ``ContextVar``: a new
thread sees the defaults. The recompute of an activation checkpoint runs during backward, i.e. on the autograd
device thread on GPU (here: ``backward()`` on a worker thread on CPU, the way nemo_ac's ``train.backward_on_thread``
emulates it; on ``--device cuda`` the real device thread).

- ``thread_config``: the recompute reads ``recompile_limit``, ``capture_scalar_outputs`` and ``dynamic_sources``
  that the forward thread set. Affected: it sees the defaults (8, False, ''). Not affected means torch propagates
  the config to the autograd thread itself and the forward-thread context is not needed.
- ``recompute_thread``: AC(compile(block)) under selective AC where the block syncs on
  ``tokens_per_group.tolist()`` (an MoE experts loop). The forward compiles it with ``capture_scalar_outputs=True``
  (one graph); the recompute misses the forward's cache entry (its thread's intra-op thread count is part of the
  global-state guard, as on the device thread), compiles with the thread's default ``False``, graph-breaks at
  ``tolist()`` and runs other graphs than the forward::

      torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the following tensors
      have different metadata than during the forward pass.

  (or, under SAC, ``... encountered during backward but not found in storage``). The workaround:
  ``forward_thread_compile_context`` in the checkpoint's ``context_fn``. Backend ``aot_eager``: the failure is in
  Dynamo's per-thread config and cache, before any backend; aot_eager still partitions like inductor does and
  compiles in a second.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nemo_ac import compat
from nemo_ac.doctor.isolation import fresh_dynamo, on_thread, other_num_threads
from nemo_ac.doctor.probes_sac import torch_sac_context_fn
from nemo_ac.doctor.result import ProbeRun, recording
from nemo_ac.workarounds.dynamo_settings import dynamo_setting, dynamo_settings_patched

ContextFactory = Callable[[], Any]

# Non-default values the forward thread sets (what nemo_ac's compiled blocks run under).
FORWARD_CONFIG = {"recompile_limit": 48, "capture_scalar_outputs": True}
FORWARD_SOURCES = r".*\['max_seqlen'\]$"
THREAD_CONFIG_DESYNC = re.compile(r"the recompute on thread '[^']*' saw")
RECOMPUTE_DESYNC = re.compile(
    r"Recomputed values for the following tensors have different metadata|not found in storage|"
    r"number of tensors saved during the original forward and recomputed"
)
HIDDEN, GROUPS, ROWS = 16, 4, 22  # ROWS equals no model dimension (Dynamo would duck-size them together)


def _read_config() -> tuple[str, int, bool, str]:
    return (
        threading.current_thread().name,
        dynamo_setting("recompile_limit"),
        dynamo_setting("capture_scalar_outputs"),
        torch.compiler.config.dynamic_sources,
    )


class _ConfigReader(torch.autograd.Function):
    """Identity whose forward records the compile config of the thread running it (forward and recompute)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seen: list) -> torch.Tensor:
        seen.append(_read_config())
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _backward(loss: torch.Tensor, *, device: torch.device, num_threads: int | None = None) -> None:
    """On CUDA the autograd engine already recomputes on its device thread; on CPU run backward on a worker."""
    if device.type == "cuda" and num_threads is None:
        loss.backward()
    else:
        on_thread(loss.backward, num_threads=num_threads, name="nemo_ac-doctor-backward")


def run_thread_config_probe(*, workaround: bool, device: str = "cpu") -> ProbeRun:
    """Does the recompute on the backward thread see the forward thread's compile config?"""
    dev = torch.device(device)
    run = ProbeRun(workaround=workaround)
    seen: list[tuple[str, int, bool, str]] = []
    context_fn = compat.forward_thread_compile_context if workaround else None
    x = torch.randn(ROWS, HIDDEN, device=dev, requires_grad=True)
    with recording(run, expected=THREAD_CONFIG_DESYNC):
        with dynamo_settings_patched(FORWARD_CONFIG), torch.compiler.config.patch(dynamic_sources=FORWARD_SOURCES):
            kwargs = {} if context_fn is None else {"context_fn": context_fn}
            out = checkpoint(lambda t: _ConfigReader.apply(t, seen).sin(), x, use_reentrant=False, **kwargs)
        _backward(out.sum(), device=dev)
        if len(seen) != 2:
            raise AssertionError(f"expected a forward and a recompute, saw {len(seen)} calls")
        forward, recompute = seen
        run.facts.update(forward_thread=forward[0], recompute_thread=recompute[0])
        if recompute[0] == forward[0]:
            raise AssertionError("the recompute ran on the forward thread: the probe cannot tell")
        if recompute[1:] != forward[1:]:
            raise RuntimeError(
                f"the recompute on thread '{recompute[0]}' saw recompile_limit={recompute[1]}, "
                f"capture_scalar_outputs={recompute[2]}, dynamic_sources={recompute[3]!r}; the forward thread set "
                f"{forward[1]}, {forward[2]}, {forward[3]!r}"
            )
    return run


class ScalarSyncBlock(nn.Module):
    """A block with an MoE experts loop: rows split by ``tokens_per_group.tolist()``, one matmul per group."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, GROUPS)
        self.weights = nn.Parameter(torch.randn(GROUPS, HIDDEN, HIDDEN) / HIDDEN**0.5)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.router(x), dim=-1)
        weight, group = scores.max(dim=-1)
        order = torch.argsort(group, stable=True)
        rows = x[order]
        # counts via a one-hot sum: static shape (bincount would graph-break in both passes alike)
        tokens_per_group = (group.unsqueeze(-1) == torch.arange(GROUPS, device=x.device)).sum(dim=0)
        outs = [chunk @ self.weights[g] for g, chunk in enumerate(torch.split(rows, tokens_per_group.tolist()))]
        mixed = torch.empty_like(rows).index_copy(0, order, torch.cat(outs, dim=0))
        return self.out(torch.relu(mixed) * weight.unsqueeze(-1))


def run_recompute_thread_probe(
    *, workaround: bool, device: str = "cpu", sac_context_fn: ContextFactory | None = None
) -> ProbeRun:
    """AC(compile(block)) under SAC, backward on another thread that misses the forward's cache entry.

    sac_context_fn: the SAC ``context_fn`` the region uses (default: torch's modes with a save-matmuls policy);
        with the workaround it is wrapped by ``compat.with_forward_thread_compile_context``. Pass an already
        wrapped factory (e.g. Automodel's, via ``nemo_ac.compat.automodel``) with ``workaround=False`` to probe
        exactly that factory.
    """
    dev = torch.device(device)
    run = ProbeRun(workaround=workaround)
    base = sac_context_fn if sac_context_fn is not None else torch_sac_context_fn()
    context_fn = compat.with_forward_thread_compile_context(base) if workaround else base
    torch.manual_seed(0)
    block = ScalarSyncBlock().to(dev)
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dev).requires_grad_()
    expected = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    with fresh_dynamo(), recording(run, expected=RECOMPUTE_DESYNC):
        block.forward = torch.compile(block.forward, backend="aot_eager", dynamic=False)
        with dynamo_settings_patched(FORWARD_CONFIG):
            out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        loss = out.square().sum()
        grads = on_thread(
            lambda: torch.autograd.grad(loss, [x, *block.parameters()]),
            num_threads=other_num_threads(),
            name="nemo_ac-doctor-backward",
        )
        worst = max(float((g - e).abs().max()) for g, e in zip(grads, expected))
        run.facts["max_grad_error_vs_eager"] = worst
        if worst > 1e-4:
            raise AssertionError(f"gradients differ from eager by up to {worst:.3g}")
    return run
