"""Compile layouts: which block gets which, where the forward-thread context goes, names kept, and the silent eager
fallback that ``auto`` avoids (observed on a real FSDP2 model, gloo world size 1)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch._dynamo.utils import counters

from nemo_ac.config import ConfigError, load_recipe, validate_recipe
from nemo_ac.config.schema import ActivationCheckpointingConfig, CompileConfig, ModelConfig, MoEConfig
from nemo_ac.diagnostics.recompiles import CompileAccounting, EagerFallbackWarning
from nemo_ac.distributed.activation_checkpointing import apply_ac
from nemo_ac.distributed.activation_checkpointing.wrapping import block_context_fns
from nemo_ac.distributed.blocks import decoder_layers, unwrap_block
from nemo_ac.distributed.compile import apply_compile
from nemo_ac.distributed.mesh import build_meshes
from nemo_ac.distributed.parallelize import parallelize
from nemo_ac.distributed.plan import CompileLayout, decide_plan
from nemo_ac.distributed.plan.layout import recompute_contexts
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.routing_replay import routing_replay_context
from nemo_ac.preflight import preflight
from nemo_ac.workarounds.forward_thread_compile_config import forward_thread_compile_context
from tests.factories import packed_square_loss
from tests.launch import RECIPES

FULL = ActivationCheckpointingConfig(mode="full")
ON = CompileConfig(enabled=True, backend="aot_eager")


def model_config(**moe: object) -> ModelConfig:
    return ModelConfig(num_layers=3, first_k_dense_replace=1, moe=MoEConfig(**moe))


def plan_for(cfg: ModelConfig, compile_config: CompileConfig = ON, ac: ActivationCheckpointingConfig = FULL):
    return decide_plan(build_model(cfg), compile=compile_config, activation_checkpointing=ac)


def layouts_for(cfg: ModelConfig, compile_config: CompileConfig = ON, ac: ActivationCheckpointingConfig = FULL):
    return plan_for(cfg, compile_config, ac).compile_layouts()


def test_auto_puts_ac_outside_only_for_blocks_with_a_nested_fsdp_unit():
    # layer 0 is dense (first_k_dense_replace=1); layers 1, 2 are MoE with experts as their own FSDP unit
    assert layouts_for(model_config()) == ["compile_outer", "ac_outer", "ac_outer"]
    assert layouts_for(model_config(router_dtype="float32", separate_fsdp_unit=False))[1:] == ["ac_outer"] * 2
    assert layouts_for(model_config(separate_fsdp_unit=False)) == ["compile_outer"] * 3


def test_other_layout_choices():
    cfg = model_config(separate_fsdp_unit=False)
    outside = ActivationCheckpointingConfig(mode="full", placement="outside")
    assert layouts_for(cfg, ac=outside) == ["ac_outer"] * 3  # the block's own FSDP hooks are inside the checkpoint
    assert layouts_for(cfg, ac=ActivationCheckpointingConfig(mode="none")) == ["compile_outer"] * 3
    assert layouts_for(cfg, CompileConfig(enabled=True, layout="compile_outer")) == ["compile_outer"] * 3
    # compile_outer over nested FSDP units would run the MoE blocks eagerly: the plan refuses it, naming the key
    with pytest.raises(ConfigError, match=r"compile.layout: compile_outer: MoE blocks hold a nested FSDP unit"):
        layouts_for(model_config(), CompileConfig(enabled=True, layout="compile_outer"))
    assert layouts_for(cfg, CompileConfig(enabled=True, layout="ac_outer")) == ["ac_outer"] * 3
    assert layouts_for(cfg, CompileConfig(enabled=False)) == [None] * 3


def test_forward_thread_context_only_on_ac_outer_blocks():
    plan = plan_for(model_config())  # compile_outer, ac_outer, ac_outer
    contexts = [block_context_fns(b, plan=plan) for b in plan.decoder_blocks()]
    moe = [forward_thread_compile_context, routing_replay_context]  # full AC's MoE blocks also replay routing
    assert contexts == [[], moe, moe]
    off = plan_for(model_config(), CompileConfig(enabled=True, forward_thread_context=False))
    assert [block_context_fns(b, plan=off) for b in off.decoder_blocks()] == [[], *[[routing_replay_context]] * 2]


def test_blocks_are_compiled_in_place_and_keep_their_parameter_names():
    cfg = model_config()
    model = build_model(cfg)
    names = [name for name, _ in model.named_parameters()]
    plan = decide_plan(model, compile=ON, activation_checkpointing=FULL)
    apply_ac(model, plan=plan)
    wrapped_names = [name for name, _ in model.named_parameters()]
    report = apply_compile(model, plan=plan)
    assert [name for name, _ in model.named_parameters()] == wrapped_names
    assert [n.replace("._checkpoint_wrapped_module", "") for n in wrapped_names] == names
    assert [(b.layout, b.compiled) for b in report] == [
        ("compile_outer", "CheckpointWrapper"),
        ("ac_outer", "DecoderLayer"),
        ("ac_outer", "DecoderLayer"),
    ]
    layers = decoder_layers(model)
    assert "forward" in vars(layers[0]) and "forward" not in vars(unwrap_block(layers[0]))
    assert "forward" in vars(unwrap_block(layers[1]))
    # the CheckpointWrapper.forward that compile_outer traces
    assert len({b.checkpoint_entry for b in report if b.checkpoint_entry}) == 1
    with pytest.raises(RuntimeError, match="already compiled"):
        apply_compile(model, plan=plan)


def test_unknown_backend_names_the_key():
    model = build_model(model_config())
    plan = decide_plan(model, compile=CompileConfig(enabled=True, backend="inductr"), activation_checkpointing=FULL)
    with pytest.raises(ConfigError, match=r"compile.backend: 'inductr' is not a registered torch.compile backend"):
        apply_compile(model, plan=plan)


def test_validation_rejects_the_silent_eager_layouts_before_any_process_group():
    """``nemo-ac validate``'s checks (``preflight``) reach the plan's layout rules without ``--check-env``."""
    recipe = str(RECIPES / "tiny" / "qwen3_moe_tiny.yaml")

    def issues(*overrides: str) -> list[str]:
        with pytest.raises(ConfigError) as info:
            preflight(recipe, list(overrides), world_size=2, check_env=False)
        return [issue.key for issue in info.value.issues]

    assert issues("compile.enabled=true", "compile.layout=compile_outer") == ["compile.layout"]
    assert issues("compile.enabled=true", "compile.fullgraph=true") == ["compile.fullgraph"]
    fine = ["compile.enabled=true", "compile.layout=compile_outer", "model.moe.separate_fsdp_unit=false"]
    checked = preflight(recipe, fine, world_size=2, check_env=False)
    assert checked.plan is not None and checked.plan.compile_layouts() == ["compile_outer"] * 2


# ------------------------------------------------------------------------------------------------------------
# the eager fallback, observed


def sharded_tiny(layout: str | None) -> tuple[torch.nn.Module, list]:
    """The tiny recipe (experts as a nested FSDP unit) through the production parallelizer, world size 1; the model
    and the compiled checkpoint entries its plan reports. ``compile_outer``: the layout the plan refuses for these
    blocks, forced into the decided plan to observe what the refusal prevents."""
    recipe = load_recipe(RECIPES / "tiny" / "qwen3_moe_tiny.yaml", ["model.num_layers=1"])
    layout_cfg = validate_recipe(recipe, world_size=1)
    compile_config = CompileConfig(enabled=layout is not None, backend="aot_eager")
    model = build_model(recipe.model)
    plan = decide_plan(
        model,
        model_config=recipe.model,
        parallel=recipe.parallel,
        activation_checkpointing=recipe.activation_checkpointing,
        compile=compile_config,
        backend=recipe.backend,
    )
    if layout is not None:
        forced = CompileLayout(layout)
        contexts = functools.partial(
            recompute_contexts,
            layout=forced,
            forward_thread=compile_config.forward_thread_context,
            replay_routing=recipe.activation_checkpointing.replay_routing,
        )
        blocks = tuple(
            dataclasses.replace(b, compile_layout=forced, recompute_contexts=contexts(ac_mode=b.ac, moe=b.moe))
            for b in plan.blocks
        )
        plan = dataclasses.replace(plan, blocks=blocks)
    plan = parallelize(model, plan=plan, meshes=build_meshes(layout_cfg, device_type="cpu"))
    materialize_and_init(model, device=torch.device("cpu"), seed=0)
    return model, list(plan.applied.compiled_checkpoint_entries)


def test_compile_outer_over_a_nested_fsdp_unit_runs_eagerly_and_is_reported(world, fresh_dynamo):
    """compile(AC(block)) with the experts' FSDP hooks inside the checkpoint: Dynamo captures no graph at all (the
    block silently runs eagerly); validation rejects this layout, and CompileAccounting warns if it happens."""
    expected = packed_square_loss(sharded_tiny(None)[0])
    model, watch = sharded_tiny("compile_outer")
    with (
        CompileAccounting(watch_checkpoint_entries=watch) as accounting,
        pytest.warns(EagerFallbackWarning, match=r"compile\(AC\(block\)\) captured no graph"),
    ):
        assert packed_square_loss(model) == pytest.approx(expected, rel=1e-6)
        accounting.refresh()
    assert counters["stats"]["unique_graphs"] == 0
    assert accounting.metrics()["eager_fallbacks"] == 1 and accounting.metrics()["compiles_fwd"] == 1
