"""Compile probes that need no inductor: per-micro-batch ints under Dynamo, and softplus's backward under AOTAutograd.

- ``dynamic_ints`` (backend ``eager``: Dynamo only, a few hundred ms): a function of nemo_ac's ``AttentionInputs``
  with ring CP's ints (``max_seqlen``, ``cu_seqlens``' length, ``max_seqlen_q`` / ``max_seqlen_k`` /
  ``local_k_slice``) compiled over micro batches whose values all differ. Affected: Dynamo specializes the first
  batch's values and compiles again on the next (automatic dynamic; where shapes never settle it goes on until
  ``torch._dynamo hit config.recompile_limit (8)`` and then runs the block eagerly, silently). With the workaround
  (``CompileSettings`` with ``dynamic_source_patterns()``, what every compiled block runs under) one graph serves
  every batch. Not affected would mean Dynamo treats such ints as symbols by itself.
- ``softplus_layout`` (backend ``aot_eager``: AOTAutograd's partition, the layout inductor sees, without inductor):
  Gated DeltaNet's decay ``softplus(a + dt_bias)`` after a linear, consumed transposed as the chunked rule does. The
  compiled backward assumes the contiguous ``softplus_backward`` output torch's fake rule promises, but the eager
  kernel follows the transposed gradient's layout, and the linear's backward ``view`` fails::

      RuntimeError: view size is not compatible with input tensor's size and stride

  With the workaround: ``workarounds.softplus_backward_layout.softplus`` (no ``softplus_backward`` node), whose
  gradients must equal eager ``F.softplus``'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nemo_ac.config.schema import CompileConfig
from nemo_ac.distributed.compile import CompileSettings, use_compile_settings
from nemo_ac.doctor.isolation import fresh_dynamo
from nemo_ac.doctor.result import ProbeRun, recording
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.workarounds.softplus_backward_layout import softplus

SPECIALIZED = re.compile(r"Dynamo compiled \d+ graphs for \d+ micro batches")
VIEW_LAYOUT = re.compile(r"view size is not compatible with input tensor's size and stride")


@dataclass
class _RingInts:
    """Ring CP's per-micro-batch ints as they travel in ``AttentionInputs.context_parallel`` (names as in ring CP)."""

    max_seqlen_q: int
    max_seqlen_k: int
    local_k_slice: int


# (max_seqlen, max_seqlen_q, max_seqlen_k, local_k_slice, documents): every value differs from batch to batch, none
# is 0 or 1 after the first (Dynamo specializes those) and none equals the row length.
BATCHES = ((7, 3, 9, 0, 3), (11, 5, 13, 2, 5), (13, 6, 17, 3, 2))
ROW = 20


def _attention_op(x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
    """Uses each declared value as attention ops do: ints in comparisons, ``cu_seqlens``' length."""
    ring = attn.context_parallel
    pos = torch.arange(x.shape[0])
    window = (pos < ring.max_seqlen_q) & (pos < ring.max_seqlen_k) & (pos >= ring.local_k_slice)
    return x * (window & (pos < attn.max_seqlen)) + attn.cu_seqlens.float().sum() / attn.cu_seqlens.shape[0]


def _batch(max_seqlen: int, q: int, k: int, local_k_slice: int, documents: int) -> AttentionInputs:
    return AttentionInputs(
        document_ids=torch.zeros(1, ROW, dtype=torch.int32),
        cu_seqlens=torch.arange(documents + 1, dtype=torch.int32) * 4,
        max_seqlen=max_seqlen,
        context_parallel=_RingInts(q, k, local_k_slice),
    )


def run_dynamic_ints_probe(*, workaround: bool, device: str = "cpu") -> ProbeRun:
    """Graphs Dynamo compiles for micro batches with new ints each (device: unused, Dynamo's decision is the same)."""
    run = ProbeRun(workaround=workaround)
    graphs: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(len(example_inputs))
        return gm.forward

    # The settings every compiled block runs under, with the recipe key compile.dynamic_ints on (off: Dynamo alone).
    settings = CompileSettings.from_config(CompileConfig(enabled=True, dynamic_ints=workaround))
    with fresh_dynamo(), recording(run, expected=SPECIALIZED):
        compiled = torch.compile(_attention_op, backend=counting_backend)
        x = torch.randn(ROW)
        for values in BATCHES:
            attn = _batch(*values)
            with use_compile_settings(settings):
                out = compiled(x, attn)
            torch.testing.assert_close(out, _attention_op(x, attn))
        run.facts.update(graphs=len(graphs), batches=len(BATCHES), declared=bool(settings.dynamic_sources))
        if len(graphs) != 1:
            raise RuntimeError(
                f"Dynamo compiled {len(graphs)} graphs for {len(BATCHES)} micro batches: it specialized the first "
                "batch's ints (document lengths, ring CP offsets) and compiled again"
            )
    return run


SOFTPLUS_ROWS, SOFTPLUS_HEADS, SOFTPLUS_IN = 6, 3, 5  # [B, S, H] with S, H and the linear's input all different


def _decay_block(
    linear: torch.nn.Linear, x: torch.Tensor, dt_bias: torch.Tensor, softplus_fn: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """Gated DeltaNet's decay ``softplus(a(x) + dt_bias)`` [B, S, H], consumed as [B, H, S] (the chunked rule)."""
    g = softplus_fn(linear(x) + dt_bias).transpose(1, 2)
    return (g.cumsum(-1) * 2).sum()


def _decay_grads(softplus_fn: Callable[..., torch.Tensor], *, compiled: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(SOFTPLUS_IN, SOFTPLUS_HEADS)
    x = torch.randn(2, SOFTPLUS_ROWS, SOFTPLUS_IN, requires_grad=True)
    dt_bias = torch.randn(SOFTPLUS_HEADS, requires_grad=True)
    fn = torch.compile(_decay_block, backend="aot_eager") if compiled else _decay_block
    loss = fn(linear, x, dt_bias, softplus_fn)
    return list(torch.autograd.grad(loss, (x, dt_bias, linear.weight, linear.bias)))


def run_softplus_layout_probe(*, workaround: bool, device: str = "cpu") -> ProbeRun:
    """The decay's backward compiled with ``F.softplus`` (off) or nemo_ac's ``softplus`` (on); device: unused."""
    run = ProbeRun(workaround=workaround)
    with fresh_dynamo(), recording(run, expected=VIEW_LAYOUT):
        expected = _decay_grads(F.softplus, compiled=False)
        got = _decay_grads(softplus if workaround else F.softplus, compiled=True)
        worst = max(float((g - e).abs().max()) for g, e in zip(got, expected))
        run.facts["grads_match_eager_softplus"] = worst <= 1e-5
        if worst > 1e-5:
            raise AssertionError(f"gradients differ from eager F.softplus by up to {worst:.3g}")
    return run
