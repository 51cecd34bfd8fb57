"""Compiled regions under selective AC, without compiling: does torch's SAC still see inside inductor's code?

An AC(compile(block)) block runs inductor's generated code inside a SAC region. Unless inductor wraps each compiled
graph in the ``inductor_compiled_code`` op (``wrap_inductor_compiled_regions``, off by default in torch 2.13), the
SAC modes see the extern kernels that code calls and cache references to their outputs, which the same code then
reuses as buffers::

    RuntimeError: Tensor cached during selective activation checkpoint has been mutated

(or, where the write bumps no version counter, silently wrong gradients). Wrapped, torch's own modes key the
region's storage by the compiled callable's id, which changes when the recompute recompiles on another thread::

    RuntimeError: inductor_compiled_code ... encountered during backward but not found in storage

An inductor compile costs 15-30 s on CPU, so the probe stands in for it: ``_region_code`` is what inductor emits for
the block (an extern ``mm`` whose output buffer is reused for a later result), run inside an autograd function as
inductor's forward is, and every call wraps it in a fresh compiled callable (the recompute's recompile). The real
compile is ``tests/unit/distributed/activation_checkpointing/test_sac_compiled_regions.py``.

Without the workaround: torch's defaults (wrapped only if inductor wraps by default) and torch's own SAC modes. With
it: the option ``ac_outer_compile_kwargs`` sets (checked to exist in inductor's config) and nemo_ac's SAC modes,
which pass the region through; the gradients must equal those without activation checkpointing.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from nemo_ac import compat
from nemo_ac.doctor.probes_sac import save_matmuls, torch_sac_context_fn
from nemo_ac.doctor.result import ProbeRun, recording
from nemo_ac.workarounds.compiled_regions_under_sac import (
    WRAP_OPTION,
    inductor_wraps_compiled_regions,
    run_as_compiled_region,
)

REGION_DESYNC = re.compile(
    r"Tensor cached during selective activation checkpoint has been mutated|"
    r"inductor_compiled_code\S* (invocation index \d+ )?encountered during backward but not found in storage|"
    r"gradients differ from no-AC"
)
ROWS, HIDDEN, OUT = 7, 5, 3  # all different (nothing compiles here, but keep the project's habit)


def _region_code(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What inductor's code does for ``((relu(x @ w1) * 2 + 1) * (x @ w1)) @ w2``: the first matmul's output buffer
    holds the elementwise result afterwards (inductor reuses dead buffers)."""
    x, w1, w2 = inputs
    h = torch.mm(x, w1)
    torch.mul(torch.relu(h) * 2 + 1, h, out=h)
    return [torch.mm(h, w2)]


class _CompiledRegion(torch.autograd.Function):
    """inductor's compiled forward (no autograd inside) with its own backward, as AOTAutograd wraps it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, wrapped: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w1, w2)
        run = run_as_compiled_region if wrapped else lambda code, inputs: code(inputs)
        (out,) = run(_region_code, [x, w1, w2])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w1, w2 = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (x, w1, w2)]
            h = leaves[0] @ leaves[1]
            out = ((torch.relu(h) * 2 + 1) * h) @ leaves[2]
        return (*torch.autograd.grad(out, leaves, grad), None)


def _grads(*, device: torch.device, wrapped: bool, context_fn: Any | None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x, w1, w2 = (
        torch.randn(*shape, generator=generator).to(device).requires_grad_()
        for shape in ((ROWS, HIDDEN), (HIDDEN, ROWS), (ROWS, OUT))
    )

    def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return _CompiledRegion.apply(x, w1, w2, wrapped).sin()

    if context_fn is None:
        out = block(x, w1, w2)
    else:
        out = checkpoint(block, x, w1, w2, use_reentrant=False, context_fn=context_fn)
    return [g.detach().cpu() for g in torch.autograd.grad(out.sum(), (x, w1, w2))]


def run_compiled_regions_probe(*, workaround: bool, device: str = "cpu") -> ProbeRun:
    """Selective AC over an inductor-compiled block's code, forced off and on (see the module docstring)."""
    dev = torch.device(device)
    run = ProbeRun(workaround=workaround)
    with recording(run, expected=REGION_DESYNC):
        wrapped_by_torch = inductor_wraps_compiled_regions()
        run.facts["torch_wraps_by_default"] = wrapped_by_torch
        expected = _grads(device=dev, wrapped=False, context_fn=None)
        if workaround:
            options = compat.ac_outer_compile_kwargs({"backend": "inductor"})["options"]
            if options.get(WRAP_OPTION) is not True:
                raise AssertionError(f"ac_outer_compile_kwargs no longer sets {WRAP_OPTION}: {options}")
            context_fn = compat.selective_checkpoint_context_fn(policy=save_matmuls, region="doctor")
            got = _grads(device=dev, wrapped=True, context_fn=context_fn)
        else:
            got = _grads(device=dev, wrapped=wrapped_by_torch, context_fn=torch_sac_context_fn())
        worst = max(float((g - e).abs().max()) for g, e in zip(got, expected))
        run.facts["grads_match_no_ac"] = worst <= 1e-6
        if worst > 1e-6:
            raise AssertionError(f"gradients differ from no-AC by up to {worst:.3g} (silently wrong)")
    return run
