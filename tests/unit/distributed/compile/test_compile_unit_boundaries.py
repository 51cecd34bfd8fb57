"""Token dims marked dynamic at a nested FSDP unit's call: the frames on either side of that eager boundary compile
once for rows whose count changes every call (expert parallelism's received rows), where Dynamo alone compiles them
static and recompiles at the first change (``tensor '___stack0' size mismatch at index 0``).

A real FSDP2 unit (gloo, world size 1) inside a compiled module; the number of rows routed to it is read from the
data inside the graph (``.item()`` under nemo_ac's compile settings: an unbacked size), as a rank's received rows
are (the all-to-all's split sizes).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from nemo_ac.config.schema import CompileConfig
from nemo_ac.diagnostics.recompiles import CompileAccounting
from nemo_ac.distributed.compile import CompileSettings, use_compile_settings
from nemo_ac.distributed.compile.boundaries import mark_token_dims_at

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

HIDDEN = 12
TOKENS = 40  # never a model dimension


class Routed(nn.Module):
    """A block whose rows for ``experts`` (its own FSDP unit) are chosen by the data."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, 1)
        self.experts = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x[: (self.gate(x) > 0).sum().item()]  # a data-dependent row count
        out = self.experts(rows)  # FSDP2's hooks: a graph break; the unit runs eagerly
        return out.sum() + x.sum()


def compile_over_batches(*, marked: bool) -> dict[str, int]:
    torch.manual_seed(0)
    block = Routed()
    gate = nn.Linear(HIDDEN, 1)
    gate.load_state_dict(block.gate.state_dict())  # the row count, computed outside the sharded block
    fully_shard(block.experts)
    fully_shard(block)
    if marked:
        mark_token_dims_at(block.experts)  # after fully_shard, as the compiled block's first call does
    block.forward = torch.compile(block.forward, backend="aot_eager")
    counts = set()
    settings = CompileSettings.from_config(CompileConfig(enabled=True))
    with CompileAccounting() as accounting, use_compile_settings(settings):
        for seed in range(4):
            x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))
            counts.add(int((gate(x) > 0).sum()))
            block(x).backward()
        metrics = accounting.metrics()
    assert len(counts) > 2, f"the row count should change between batches: {counts}"
    return metrics


def test_rows_through_a_nested_unit_compile_once_when_marked(world):
    marked = compile_over_batches(marked=True)
    assert marked["dynamic_recompiles"] == marked["recompiles_fwd"] == 0, marked
    assert marked["graph_breaks"] >= 1, marked  # the unit's hooks really split the block


def test_without_the_marks_dynamo_recompiles_on_the_first_new_row_count(world):
    unmarked = compile_over_batches(marked=False)
    assert unmarked["dynamic_recompiles"] >= 1, unmarked
