"""Blocks holding modules Dynamo will not trace (Transformer Engine's, whose forwards TE wraps with
``no_torch_dynamo``): the plan sees them before anything is applied, compiles the rest of the block around them
(AC(compile(block)), graph breaks counted and reported) and never runs the block eagerly in silence.

Observed on the real parallelizer (FSDP2 on a gloo group of one, selective AC, torch.compile). TE cannot be
installed here (no CUDA), so a ``torch.compiler.disable``-d ``nn.Linear`` subclass plays its part: that is exactly
the mark TE's decorator leaves on its modules.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from nemo_ac.config import ConfigError, load_recipe, validate_recipe
from nemo_ac.config.schema import BackendConfig, CompileConfig
from nemo_ac.diagnostics.recompiles import CompileAccounting, EagerFallbackWarning
from nemo_ac.distributed.blocks import decoder_layers
from nemo_ac.distributed.mesh import build_meshes
from nemo_ac.distributed.parallelize import parallelize
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.distributed.untraceable import dynamo_disabled_modules
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.preflight import preflight
from tests.factories import packed_square_loss
from tests.launch import RECIPES

# No nested FSDP unit (experts in the block's unit, router in param dtype): without the disabled module, auto
# would compile these blocks as compile(AC(block)).
OVERRIDES = ["model.num_layers=2", "model.moe.separate_fsdp_unit=false", "model.moe.router_dtype=param"]


class DynamoDisabledLinear(nn.Linear):
    """A linear layer whose forward Dynamo skips, as Transformer Engine's ``te.Linear`` does."""

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def recipe():
    return load_recipe(RECIPES / "tiny" / "qwen3_moe_tiny.yaml", OVERRIDES)


def disable_o_proj(model: nn.Module) -> nn.Module:
    """Every block's attention output projection becomes Dynamo-disabled (same shape, same parameter names)."""
    for block in decoder_layers(model):
        old = block.self_attn.o_proj
        block.self_attn.o_proj = DynamoDisabledLinear(old.in_features, old.out_features, bias=False, device="meta")
    return model


def plan_for(model: nn.Module, *, compile_config: CompileConfig, backend: BackendConfig | None = None):
    r = recipe()
    return decide_plan(
        model,
        model_config=r.model,
        parallel=r.parallel,
        activation_checkpointing=r.activation_checkpointing,
        compile=compile_config,
        backend=backend if backend is not None else r.backend,
    )


AUTO = CompileConfig(enabled=True, backend="aot_eager")


def test_the_plan_compiles_blocks_with_a_dynamo_disabled_module_as_ac_outer():
    r = recipe()
    assert plan_for(build_model(r.model), compile_config=AUTO).compile_layouts() == ["compile_outer"] * 2
    model = disable_o_proj(build_model(r.model))
    assert dynamo_disabled_modules(decoder_layers(model)[0]) == {"DynamoDisabledLinear": 1}
    plan = plan_for(model, compile_config=AUTO)
    assert plan.compile_layouts() == ["ac_outer"] * 2
    assert [b.untraceable for b in plan.decoder_blocks()] == [(("DynamoDisabledLinear", 1),)] * 2
    line = next(line for line in plan.summary_lines() if "model.layers." in line)
    assert "compile ac_outer (graph breaks at DynamoDisabledLinear x1)" in line


def test_compile_outer_and_fullgraph_over_a_dynamo_disabled_module_name_the_key():
    model = disable_o_proj(build_model(recipe().model))
    with pytest.raises(ConfigError, match=r"compile.layout: compile_outer traces model.layers.0's checkpoint"):
        plan_for(model, compile_config=CompileConfig(enabled=True, layout="compile_outer"))
    with pytest.raises(ConfigError, match=r"compile.fullgraph: true fails at the graph breaks in model.layers.0"):
        plan_for(model, compile_config=CompileConfig(enabled=True, fullgraph=True))


def test_te_backends_are_planned_as_untraceable_without_importing_te():
    """The plan is made before ``apply_te_backends`` swaps TE in, so it counts what the swap will put there."""
    plan = plan_for(build_model(recipe().model), compile_config=AUTO, backend=BackendConfig(linear="te", rms_norm="te"))
    assert plan.compile_layouts() == ["ac_outer"] * 2
    # q/k/v/o projections; input, post-attention, q and k norms. Routed experts and the router stay torch.
    assert plan.decoder_blocks()[0].untraceable == (("te.Linear", 4), ("te.RMSNorm", 4))
    assert "transformer_engine" not in sys.modules
    # and before any process group, in nemo-ac validate's checks (preflight builds the model on meta for the plan)
    with pytest.raises(ConfigError) as info:
        preflight(
            str(RECIPES / "tiny" / "qwen3_moe_tiny.yaml"),
            [*OVERRIDES, "backend.linear=te", "compile.enabled=true", "compile.layout=compile_outer"],
            world_size=1,
            check_env=False,
        )
    assert info.value.keys == ["compile.layout"]
    assert "te.Linear x4" in str(info.value) and "backend.linear: te" in str(info.value)
    assert "transformer_engine" not in sys.modules


# ------------------------------------------------------------------------------------------------------------
# observed: eager in silence before, compiled around the break now


def sharded(plan_model_first: bool, *, layout: str = "auto") -> tuple[nn.Module, list]:
    """The tiny model with Dynamo-disabled projections through the production parallelizer.

    ``plan_model_first``: the plan is made before the disabled modules are put in, which is what happened with
    Transformer Engine before the planner counted its modules (TE is swapped in after the plan).
    """
    r = recipe()
    layout_cfg = validate_recipe(r, world_size=1)
    model = build_model(r.model)
    if not plan_model_first:
        disable_o_proj(model)
    plan = plan_for(model, compile_config=CompileConfig(enabled=True, backend="aot_eager", layout=layout))
    if plan_model_first:
        disable_o_proj(model)
    plan = parallelize(model, plan=plan, meshes=build_meshes(layout_cfg, device_type="cpu"))
    materialize_and_init(model, device=torch.device("cpu"), seed=0)
    return model, list(plan.applied.compiled_checkpoint_entries)


def eager_loss() -> float:
    r = recipe()
    model = disable_o_proj(build_model(r.model))
    materialize_and_init(model, device=torch.device("cpu"), seed=0)
    return packed_square_loss(model)


def test_compile_ac_over_a_dynamo_disabled_module_runs_the_block_eagerly_without_the_planner(world, fresh_dynamo):
    """The failure the planner prevents: compile(AC(block)) captures no graph at all, the block runs eagerly."""
    expected = eager_loss()
    model, watch = sharded(plan_model_first=True)
    assert watch, "the stale plan compiled the checkpoint wrapper (compile_outer)"
    with (
        CompileAccounting(watch_checkpoint_entries=watch) as accounting,
        pytest.warns(EagerFallbackWarning, match=r"compile\(AC\(block\)\) captured no graph"),
    ):
        assert packed_square_loss(model) == pytest.approx(expected, rel=1e-6)
        accounting.refresh()
    assert counters["stats"]["unique_graphs"] == 0
    # One report for the shared CheckpointWrapper.forward code: after its empty first compile Dynamo skips it.
    assert accounting.metrics()["eager_fallbacks"] == 1


def test_ac_outer_compiles_around_the_dynamo_disabled_module_and_counts_the_breaks(world, fresh_dynamo):
    expected = eager_loss()
    model, watch = sharded(plan_model_first=False)
    assert watch == []  # no compile(AC(block)) entry at all
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)
        with CompileAccounting(watch_checkpoint_entries=watch) as accounting:
            assert packed_square_loss(model) == pytest.approx(expected, rel=1e-6)
            metrics = accounting.metrics()
    graph_breaks = int(sum(counters["graph_break"].values()))
    assert metrics["eager_fallbacks"] == 0
    # Each block graph-breaks where it calls the disabled projection; the pieces before and after it compile.
    assert graph_breaks >= 2 and metrics["graph_breaks"] == graph_breaks
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])
    assert any("Skip" in reason or "disable" in reason for reason in counters["graph_break"]), dict(
        counters["graph_break"]
    )
    assert f"{graph_breaks} graph breaks" in accounting.report()
