"""Block layouts in the compile summary: identical blocks share one graph, a new layout's first compile is counted
apart from a recompile, and an automatic-dynamic recompile (a size compiled static that then changed) is counted
as the failure it is.

Backend ``eager``: what is counted are Dynamo's compiles and guards, not generated code.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_ac.config.schema import ActivationCheckpointingConfig, CompileConfig
from nemo_ac.diagnostics.recompiles import CompileAccounting, compiling_layout
from nemo_ac.distributed.compile import apply_compile
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from tests.factories import qwen3_5_config

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

NO_AC = ActivationCheckpointingConfig(mode="none")


def hybrid_model(layer_pattern: str) -> tuple[torch.nn.Module, list]:
    """The tiny Qwen3.5 decoder with ``layer_pattern`` (L = Gated DeltaNet, A = attention), its blocks compiled
    (no AC, no FSDP: one code object for every block's forward); the model and apply_compile's report."""
    cfg = dataclasses.replace(qwen3_5_config(), layer_pattern=layer_pattern, num_layers=len(layer_pattern))
    model = build_model(cfg)
    plan = decide_plan(model, compile=CompileConfig(enabled=True, backend="eager"), activation_checkpointing=NO_AC)
    report = apply_compile(model, plan=plan)
    materialize_and_init(model, device=torch.device("cpu"), seed=0)
    return model, report


def forward(model: torch.nn.Module, *, seq: int) -> None:
    ids = torch.randint(0, 96, (1, seq), generator=torch.Generator().manual_seed(seq))
    documents = torch.zeros(1, seq, dtype=torch.long)
    model(ids, position_ids=torch.arange(seq).unsqueeze(0), attn=build_attention_inputs(documents))


def test_blocks_of_one_structure_share_a_layout_key_and_a_graph():
    model, report = hybrid_model("LAA")
    assert [b.layout_key for b in report] == ["block 0 (compile_outer)", *["block 1 (compile_outer)"] * 2]
    with CompileAccounting() as accounting:
        forward(model, seq=37)
        first = accounting.metrics()
        forward(model, seq=37)
        m = accounting.metrics()
    # block 0 compiles its frame; block 1's layout compiles it once more (same code, another mixer); block 2 reuses
    # block 1's graph; a second step compiles nothing
    assert (first["compiles_fwd"], first["layout_compiles"], first["recompiles_fwd"]) == (2, 1, 0), first
    assert m == first
    assert "1 new-layout compiles" in accounting.report() and "FAILURE" not in accounting.report()


def test_a_size_compiled_static_that_changes_is_an_automatic_dynamic_recompile():
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    compiled = torch.compile(scale, backend="eager", dynamic=None)  # automatic dynamic: static first
    with CompileAccounting() as accounting:
        with compiling_layout("block 0"):
            compiled(torch.ones(166))
            compiled(torch.ones(173))  # size mismatch at index 0: recompiled with the size dynamic
            compiled(torch.ones(180))  # now dynamic: no compile
        m = accounting.metrics()
    assert (m["compiles_fwd"], m["layout_compiles"], m["recompiles_fwd"], m["dynamic_recompiles"]) == (2, 0, 1, 1)
    assert "FAILURE: 1 automatic-dynamic recompiles" in accounting.report()


def test_a_guard_failure_under_a_layout_already_compiled_is_a_recompile():
    def pick(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n

    compiled = torch.compile(pick, backend="eager", dynamic=False)
    with CompileAccounting() as accounting:
        with compiling_layout("block 0"):
            compiled(torch.ones(3), 2)
        with compiling_layout("block 1"):
            compiled(torch.ones(3), 3)  # another layout's first compile of this frame
            compiled(torch.ones(3), 4)  # the same layout again: a recompile (an int specialized)
        m = accounting.metrics()
    assert (m["compiles_fwd"], m["layout_compiles"], m["recompiles_fwd"], m["dynamic_recompiles"]) == (3, 1, 1, 0)
    assert sum(accounting.threads["fwd"].reasons.values()) == 1
