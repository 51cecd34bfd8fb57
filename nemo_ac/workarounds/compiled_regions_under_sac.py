"""Selective AC over an inductor-compiled block (``compile.layout: ac_outer``, AC(compile(block))).

Errors prevented (torch 2.13, ring / ulysses CP under ac_outer + selective AC): wrong gradients *without any error*
(grad norm 3.5% / 10% off), or, where a version counter is bumped::

    RuntimeError: Tensor cached during selective activation checkpoint has been mutated

and, once the region is made opaque, on a recompute that recompiles on another thread::

    RuntimeError: inductor_compiled_code ... encountered during backward but not found in storage

Why: the checkpoint's dispatch modes see every op inductor's generated code calls; selective AC then caches
*references* to outputs of ops inside inductor code (a functional all-to-all, an extern matmul), which inductor
reuses or writes in place later in the same graph, and the recompute replays overwritten data.

Fix, two parts: ``ac_outer_compile_kwargs`` turns on inductor's ``wrap_inductor_compiled_regions``, so each compiled
graph runs as one ``inductor_compiled_code`` higher-order op that the SAC modes see whole; and
``is_compiled_region`` lets nemo_ac's SAC modes pass that op through (always recomputed): inductor owns its buffers,
and torch keys its storage by the compiled callable's id, which changes whenever the recompute recompiles on
another thread (the autograd device thread on GPU).

Upstream: none filed by nemo_ac; the option is torch's own answer for SAC over compiled code (it exists from 2.12).
Delete when: torch's SAC treats compiled regions as opaque and uncached by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

WRAP_OPTION = "wrap_inductor_compiled_regions"


def _inductor_compiled_code_op() -> Any:
    try:
        from torch._higher_order_ops.wrap import inductor_compiled_code
    except ImportError:  # torch releases without the HOP cannot wrap compiled regions either
        return None
    return inductor_compiled_code


_INDUCTOR_COMPILED_CODE = _inductor_compiled_code_op()


def is_compiled_region(func: Any) -> bool:
    """Whether ``func`` is a whole inductor-compiled region (the ``inductor_compiled_code`` higher-order op)."""
    return _INDUCTOR_COMPILED_CODE is not None and func is _INDUCTOR_COMPILED_CODE


def ac_outer_compile_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` kwargs for a block compiled *inside* an activation checkpoint: inductor wraps each
    compiled graph in ``inductor_compiled_code`` (other backends are returned unchanged)."""
    if kwargs.get("backend") != "inductor":
        return kwargs
    options = {**(kwargs.get("options") or {}), WRAP_OPTION: True}
    return {**kwargs, "options": options}


def inductor_wraps_compiled_regions() -> bool:
    """inductor's current ``wrap_inductor_compiled_regions`` (torch 2.13's default: False, so SAC sees every op of
    inductor's code). Raises ``AttributeError`` on a torch without the option: there ``ac_outer_compile_kwargs``
    passes an option inductor rejects, and the workaround no longer applies."""
    from torch._inductor import config

    return bool(getattr(config, WRAP_OPTION))


def run_as_compiled_region(
    code: Callable[[list[torch.Tensor]], list[torch.Tensor]], inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """``code(inputs)`` run as inductor runs a compiled graph under ``wrap_inductor_compiled_regions``: one
    ``inductor_compiled_code`` op around a fresh compiled callable (a new id per call, as after a recompile on
    another thread). For the doctor's compile-free probe; raises ``RuntimeError`` on a torch without the op."""
    if _INDUCTOR_COMPILED_CODE is None:
        raise RuntimeError("this torch has no inductor_compiled_code higher-order op to wrap compiled regions in")
    from torch._higher_order_ops.wrap import InductorCompiledCallable

    return _INDUCTOR_COMPILED_CODE(InductorCompiledCallable(code), inputs)
