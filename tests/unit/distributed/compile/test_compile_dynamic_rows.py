"""Rows whose length varies per micro batch compile once: the plan says rows vary (``CompilePlan.dynamic_rows``),
and the compiled block's entry marks the token dims of its inputs dynamic (hidden states, and the document ids in
the attention metadata beside them), where Dynamo alone compiles the first length static and recompiles at the
second (``tensor 'hidden' size mismatch at index 1. expected 64, actual 40``).

One process, no model: a block-shaped function of ``(hidden [B, S, H], *, attn)`` whose row lengths include one
equal to the hidden size (the duck-sizing trap), compiled with ``aot_eager`` under the compile accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nemo_ac.config.schema import CompileConfig, DataConfig
from nemo_ac.diagnostics.recompiles import CompileAccounting
from nemo_ac.distributed.compile.apply import _CompiledForward
from nemo_ac.distributed.plan.decide import compile_plan
from nemo_ac.workarounds.dynamic_per_batch_ints import mark_row_dims

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

HIDDEN = 32
LENGTHS = (24, 32, 40, 48)  # one equals HIDDEN: a marked row length must not be tied to a static model dim


@dataclass
class Meta:
    """Stands for AttentionInputs: a dataclass, not a pytree, holding [B, S] int document ids."""

    document_ids: torch.Tensor


def block(hidden: torch.Tensor, *, attn: Meta) -> torch.Tensor:
    same = (attn.document_ids[:, :, None] == attn.document_ids[:, None, :]).to(hidden.dtype)  # [B, S, S]
    return (same @ hidden).tanh() + hidden


def compile_over_lengths(*, dynamic_rows: bool) -> dict[str, int]:
    compiled = _CompiledForward(
        torch.compile(block, backend="aot_eager"), layout_key="block 0 (test)", dynamic_rows=dynamic_rows
    )
    with CompileAccounting() as accounting:
        for seq in LENGTHS:
            hidden = torch.randn(2, seq, HIDDEN, requires_grad=True)
            docs = (torch.arange(seq) // 5).expand(2, seq).to(torch.int32).contiguous()
            compiled(hidden, attn=Meta(document_ids=docs)).sum().backward()
        return accounting.metrics()


def test_varying_rows_compile_once_when_the_entry_marks_them():
    metrics = compile_over_lengths(dynamic_rows=True)
    assert metrics["compiles_fwd"] == 1 and metrics["recompiles_fwd"] == metrics["dynamic_recompiles"] == 0, metrics


def test_without_the_marks_the_second_length_recompiles():
    metrics = compile_over_lengths(dynamic_rows=False)
    assert metrics["dynamic_recompiles"] >= 1, metrics


def test_mark_row_dims_marks_token_dims_inside_dataclasses_and_view_bases():
    base = torch.randn(2, 40, 2 * HIDDEN)
    hidden = base[..., :HIDDEN]  # a view: a frame that takes it rebuilds it from its base
    ids, counts = torch.zeros(2, 40, dtype=torch.int32), torch.zeros(8)
    mark_row_dims(((hidden,), {"attn": Meta(document_ids=ids), "counts": counts}))
    assert hidden._dynamo_weak_dynamic_indices == base._dynamo_weak_dynamic_indices == {0, 1}  # not the features
    assert ids._dynamo_weak_dynamic_indices == {0, 1}  # integer ids: every dim is a token dim
    assert not hasattr(counts, "_dynamo_weak_dynamic_indices")  # 1-d: left to DYNAMIC_INT_ARGS


def test_the_plan_marks_rows_only_when_they_vary_under_automatic_dynamic():
    varying, fixed = DataConfig(fixed_length=False), DataConfig()
    assert compile_plan(CompileConfig(enabled=True), data=varying).dynamic_rows
    assert not compile_plan(CompileConfig(enabled=True), data=fixed).dynamic_rows
    assert not compile_plan(CompileConfig(enabled=True, dynamic=True), data=varying).dynamic_rows  # all dynamic
    assert not compile_plan(CompileConfig(enabled=True, dynamic=False), data=varying).dynamic_rows  # per length
    assert not compile_plan(CompileConfig(enabled=True), data=DataConfig(kind="text", fixed_length=False)).dynamic_rows
