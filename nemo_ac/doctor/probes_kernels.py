"""``aten._grouped_mm``'s fake rule, asked directly: what ``torch.compile`` of a grouped-GEMM experts block meets.

Dynamo traces with fake tensors, so the fake rule decides whether the experts block compiles at all. torch 2.13's
rule accepts bf16 only (``torch/_meta_registrations.py::_meta_grouped_mm_common``)::

    RuntimeError: Expected inputs of BF16 type but got mat_a.dtype=torch.float32 and mat_b.dtype=torch.float32.

No compile needed: without the workaround the rule runs on fake tensors in each dtype nemo_ac's experts use
(``GROUPED_MM_DTYPES``); affected where one dtype fails. With it, ``traceable_grouped_mm`` (nemo_ac's custom op for
those dtypes) runs on fake tensors at the experts' layout (weights stored ``[E, N, K]`` and passed transposed), and in
fp32 on real tensors its output and gradients must equal a per-expert loop of plain matmuls.
"""

from __future__ import annotations

import re

import torch

from nemo_ac.doctor.result import ProbeRun, recording
from nemo_ac.workarounds.fake_world import fake_tensor_mode
from nemo_ac.workarounds.grouped_mm_fake_rule import GROUPED_MM_DTYPES, aten_fake_rule_error, traceable_grouped_mm

FAKE_RULE = re.compile(r"Expected inputs of BF16 type|Expected mat_a to be BFloat16")
TOKENS, HIDDEN, INTER = 24, 16, 8  # 16-byte aligned rows in bf16, as the experts' shapes are
GROUP_ENDS = (5, 5, 17, 24)  # four experts, one of them without tokens


def _experts(dtype: torch.dtype, *, requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=generator).to(dtype).requires_grad_(requires_grad)
    stored = torch.randn(len(GROUP_ENDS), INTER, HIDDEN, generator=generator).to(dtype).requires_grad_(requires_grad)
    return x, stored, torch.tensor(GROUP_ENDS, dtype=torch.int32)


def _loop_reference(x: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    starts = (0, *GROUP_ENDS[:-1])
    return torch.cat([x[start:end] @ stored[e].T for e, (start, end) in enumerate(zip(starts, GROUP_ENDS))])


def _check_custom_op() -> dict[str, str]:
    """nemo_ac's op: fake shapes in every dtype, fp32 values and gradients against the loop."""
    traced: dict[str, str] = {}
    for dtype in GROUPED_MM_DTYPES:
        with fake_tensor_mode():
            x, stored, offs = _experts(dtype)
            out = traceable_grouped_mm(x, stored.transpose(-2, -1), offs)
        if tuple(out.shape) != (TOKENS, INTER) or out.dtype != dtype:
            raise AssertionError(f"{dtype}: traced output {tuple(out.shape)} {out.dtype}, not {(TOKENS, INTER)}")
        traced[str(dtype).removeprefix("torch.")] = "traced"
    x, stored, offs = _experts(torch.float32, requires_grad=True)
    got = traceable_grouped_mm(x, stored.transpose(-2, -1), offs)
    grads = torch.autograd.grad(got.square().sum(), (x, stored))
    want = _loop_reference(x, stored)
    want_grads = torch.autograd.grad(want.square().sum(), (x, stored))
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)
    return traced


def run_grouped_mm_fake_probe(*, workaround: bool, device: str = "cpu") -> ProbeRun:
    """Off: torch's fake rule in every experts dtype; on: nemo_ac's op (device: unused, the rule is the same)."""
    run = ProbeRun(workaround=workaround)
    with recording(run, expected=FAKE_RULE):
        if workaround:
            run.facts["custom_op"] = _check_custom_op()
            run.facts["values_and_grads_match_loop"] = True
        else:
            errors = {str(dtype).removeprefix("torch."): aten_fake_rule_error(dtype) for dtype in GROUPED_MM_DTYPES}
            run.facts["aten_fake_rule"] = {
                name: "accepts" if error is None else "rejects" for name, error in errors.items()
            }
            failing = [error for error in errors.values() if error is not None]
            if failing:
                raise RuntimeError(failing[0])
    return run
