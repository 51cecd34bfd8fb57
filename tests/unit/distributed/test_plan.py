"""The parallel plan: decided from the recipe and the model contract before anything is applied, printed one line
per distinct block plan, and the only place the run reads parallelize's decisions from."""

from __future__ import annotations

import dataclasses

import pytest

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.distributed.plan import (
    ACMode,
    BlockKind,
    Chosen,
    CompileLayout,
    FSDPUnit,
    NestedUnit,
    RecomputeContext,
    SelectiveACPlan,
    decide_plan,
    recipe_kernels,
)
from nemo_ac.models import build_model
from nemo_ac.models.layers.experts import GroupedExperts
from nemo_ac.trainer.build import plan_recipe
from tests.launch import RECIPES

MAKE_RUN = RECIPES / "tiny" / "qwen3_6_medpix_tiny.yaml"


def _plan(recipe_path, overrides=(), *, world_size: int, torch_version: str | None = None):
    recipe = load_recipe(str(recipe_path), list(overrides))
    layout = validate_recipe(recipe, world_size=world_size)
    # experts_impl / attention auto -> what the run builds on CPU
    return plan_recipe(recipe, layout, device_type="cpu", torch_version=torch_version)


def test_make_run_plan_prints_one_line_per_distinct_block_plan():
    lines = _plan(MAKE_RUN, world_size=4, torch_version="2.13.0").summary_lines()
    assert lines == [
        "kernels | experts grouped_mm (auto: cpu float32) | attention tiled (auto: cpu) | linear_attention torch "
        "(auto: cpu) | linear torch (set) | rms_norm torch (set) | dispatcher torch (set) | router float32 "
        "(auto: cpu float32)",
        "plan | ep 2 (torch) | cp 2 (ulysses) | fsdp float32/float32 prefetch fwd none bwd default",
        "plan | model.visual.blocks.[0] (1) | no mixer | dense | AC selective | eager | fully_shard(AC(block))",
        "plan | model.language_model.layers.[0] (1) | linear_attention | moe | own FSDP units: router, experts | "
        "AC selective + forward_thread_compile, routing_replay | compile ac_outer | fully_shard(AC(block)) | "
        "linear_attention torch, ulysses cp2 | experts grouped_mm | dispatch torch ep2",
        "plan | model.language_model.layers.[1] (1) | softmax_attention | moe | own FSDP units: router, experts | "
        "AC selective + forward_thread_compile, routing_replay | compile ac_outer | fully_shard(AC(block)) | "
        "attention tiled, ulysses cp2 | experts grouped_mm | dispatch torch ep2",
        "plan | workarounds: profiler_ops_in_sac, fsdp_hooks_in_sac, forward_thread_compile_config, "
        "compiled_regions_under_sac, dynamic_per_batch_ints",
    ]


def test_the_kernels_line_lists_only_the_slots_the_model_uses():
    """A kernel slot prints where the model has its block kind: no Mamba-2 or linear-attention kernel for GLM, no
    linear attention for Nemotron-H, no mamba for Qwen3.5; the KernelPlan itself still holds every slot."""
    slots = {}
    for name in ("glm_4_5_air_tiny", "nemotron_super_v3_tiny", "qwen3_6_medpix_tiny"):
        plan = _plan(RECIPES / "tiny" / f"{name}.yaml", world_size=4 if "medpix" in name else 2)
        first = plan.summary_lines()[0]
        assert first == plan.kernels_line() and first.startswith("kernels | "), first
        slots[name] = [part.split(" ", 1)[0] for part in first.split(" | ")[1:]]
        assert plan.kernels.summary_line().count(" | ") == 8  # every slot when asked for all
    # The tiny recipes keep fp32 routers, as their flagships: the router's GEMM is a slot.
    moe_and_modules = ["experts", "attention", "linear", "rms_norm", "dispatcher", "router"]
    assert slots["glm_4_5_air_tiny"] == moe_and_modules
    assert slots["nemotron_super_v3_tiny"] == [
        "experts", "attention", "mamba", "linear", "rms_norm", "dispatcher", "router"
    ]  # fmt: skip
    assert slots["qwen3_6_medpix_tiny"] == [
        "experts",
        "attention",
        "linear_attention",
        "linear",
        "rms_norm",
        "dispatcher",
        "router",
    ]
    dense = plan.kernels.slots_used(mixers={"softmax_attention"}, moe=False)
    assert dense == ("attention", "linear", "rms_norm")
    with pytest.raises(ValueError, match="no KernelPlan slot"):
        plan.kernels.summary_line(["ssm"])  # a mixer kind is no slot name


def test_equal_blocks_share_a_line_and_dense_blocks_get_no_nested_units():
    plan = _plan(RECIPES / "tiny" / "glm_4_5_air_tiny.yaml", world_size=2)
    dense, *moe = plan.decoder_blocks()
    assert dense.nested_units == () and not dense.moe and all(b.nested_units == ("router", "experts") for b in moe)
    assert all(b.offload and b.ac == "full" for b in plan.decoder_blocks())
    assert dense.recompute_contexts == () and all(b.recompute_contexts == ("routing_replay",) for b in moe)
    block_lines = [line for line in plan.summary_lines() if "model.layers." in line]
    assert len(block_lines) == 2 and f"model.layers.[1-{len(moe)}] ({len(moe)})" in block_lines[1]


def test_workarounds_follow_the_gates_and_the_layout():
    # torch 2.12's SAC recompute asks the policy again: neither SAC desync exists there (gates.py).
    assert _plan(MAKE_RUN, world_size=4, torch_version="2.12.1").workarounds == (
        "forward_thread_compile_config",
        "compiled_regions_under_sac",
        "dynamic_per_batch_ints",
    )
    full = _plan(MAKE_RUN, ["activation_checkpointing.mode=full"], world_size=4, torch_version="2.13.0")
    assert "profiler_ops_in_sac" not in full.workarounds and "fsdp_hooks_in_sac" not in full.workarounds
    for release in ("2.14.1", "2.15.0"):
        assert _plan(MAKE_RUN, world_size=4, torch_version=release).workarounds == (
            "profiler_ops_in_sac",
            "fsdp_hooks_in_sac",
            "forward_thread_compile_config",
            "compiled_regions_under_sac",
            "dynamic_per_batch_ints",
        )
    eager = _plan(MAKE_RUN, ["compile.enabled=false"], world_size=4, torch_version="2.13.0")
    assert eager.compile is None and eager.compile_layouts() == [None, None]
    assert eager.workarounds == ("profiler_ops_in_sac", "fsdp_hooks_in_sac")


def test_ops_between_compiled_graphs_is_decided_once_per_block_and_the_dispatcher_reads_it():
    """A checkpointed block compiled inside its checkpoint (ac_outer) calls its custom ops between compiled graphs;
    the shared EP dispatcher does so when any MoE block does. The apply steps read these fields, nothing else."""
    ac_outer = _plan(MAKE_RUN, world_size=4)
    assert [b.ops_between_graphs for b in ac_outer.decoder_blocks()] == [True, True]
    assert ac_outer.dispatcher_between_graphs()
    # compile_outer needs blocks without nested FSDP units: no fp32 router unit, no EP (its experts are a unit).
    compile_outer = [
        "compile.layout=compile_outer",
        "model.moe.separate_fsdp_unit=false",
        "model.moe.router_dtype=param",
        "parallel.ep=1",
    ]
    for overrides in (
        compile_outer,
        ["activation_checkpointing.mode=none"],
        ["compile.enabled=false"],
    ):
        plan = _plan(MAKE_RUN, overrides, world_size=4)
        assert not any(b.ops_between_graphs for b in plan.decoder_blocks()), overrides
        assert not plan.dispatcher_between_graphs(), overrides


def test_ring_over_recurrent_mixers_is_planned_as_state_passing():
    """Gated DeltaNet (and Mamba-2) layers take ring CP (state passing) beside the attention layers' K/V ring."""
    lines = _plan(MAKE_RUN, ["parallel.cp_type=ring"], world_size=4, torch_version="2.13.0").summary_lines()
    assert "| linear_attention torch (auto: ring CP passes the torch op's state) |" in lines[0]
    assert lines[1].startswith("plan | ep 2 (torch) | cp 2 (ring) |")
    assert "| linear_attention torch, state-passing ring cp2 |" in lines[3]
    assert "| attention tiled, ring cp2 |" in lines[4]


def test_a_mixer_kind_without_a_cp_op_fails_in_the_plan_before_anything_is_applied():
    recipe = load_recipe(str(MAKE_RUN))
    model = build_model(recipe.model)
    model.model.language_model.layers[0].linear_attn.mixer_kind = "retention"  # a kind no CP op exists for
    with pytest.raises(ValueError, match=r"ring has no context-parallel op for model.language_model.layers.0's"):
        decide_plan(model, parallel=dataclasses.replace(recipe.parallel, cp_type="ring"), cp=2)


def test_the_readme_shows_the_plan_make_run_prints():
    readme = (RECIPES.parent / "README.md").read_text()
    block = readme.split("<!-- plan:make-run -->\n```text\n", 1)[1].split("```", 1)[0]
    assert block.splitlines() == _plan(MAKE_RUN, world_size=4).summary_lines()


def test_kernels_are_decided_once_and_the_model_is_built_with_them():
    """One ``KernelPlan`` per run: the model is built with its experts impl (the recipe keeps the ``auto`` the user
    wrote), the printed kernels line reads from it, and the block labels derive from it (the model is never probed
    for what was chosen)."""
    recipe = load_recipe(str(MAKE_RUN))
    kernels = recipe_kernels(recipe, device_type="cpu")
    assert kernels.experts == Chosen("grouped_mm", "auto: cpu float32")
    assert kernels.attention == Chosen("tiled", "auto: cpu")
    assert kernels.summary_line().startswith(  # every slot: the plan's kernels_line picks the model's
        "kernels | experts grouped_mm (auto: cpu float32) | attention tiled (auto: cpu) | "
        "linear_attention torch (auto: cpu) | mamba torch (auto: cpu) | linear torch (set)"
    )
    model = build_model(recipe.model, experts_impl=kernels.experts.value)
    assert {m.impl for m in model.modules() if isinstance(m, GroupedExperts)} == {"grouped_mm"}
    assert (recipe.model.moe.experts_impl, recipe.backend.attention) == ("auto", "auto")
    assert plan_recipe(recipe, validate_recipe(recipe, world_size=4), device_type="cpu").kernels == kernels
    # The label follows the plan's choice, not an attribute of the module.
    loop = dataclasses.replace(kernels, experts=Chosen("loop", "set"))
    plan = decide_plan(model, model_config=recipe.model, parallel=recipe.parallel, kernels=loop)
    labels = {dict(b.kernels)["experts"] for b in plan.decoder_blocks()}
    assert plan.kernels is loop and labels == {"loop"}


def test_the_plan_vocabulary_is_typed():
    plan = _plan(MAKE_RUN, world_size=4, torch_version="2.13.0")
    block = plan.decoder_blocks()[0]
    assert block.ac is ACMode.SELECTIVE and block.compile_layout is CompileLayout.AC_OUTER
    assert block.fsdp_unit is FSDPUnit.WRAPPER and block.kind is BlockKind.DECODER
    assert block.recompute_contexts == (
        RecomputeContext.SAC_MODES,
        RecomputeContext.FORWARD_THREAD_COMPILE,
        RecomputeContext.ROUTING_REPLAY,
    )
    assert block.nested_units == (NestedUnit.ROUTER, NestedUnit.EXPERTS)
    assert plan.selective == SelectiveACPlan()  # the policy's switches as values, no config section


@pytest.mark.parametrize(("device_type", "pinned"), [("cpu", False), ("cuda", True)])
def test_full_optimizer_offload_is_a_plan_decision_with_pinning_only_on_cuda(device_type: str, pinned: bool) -> None:
    """``train.optimizer_offload: full`` -> FSDP's shards on the host, pinned where a CUDA device copies them (pinning
    needs CUDA; on a CPU run the host is the device). The other policies leave FSDP's shards on the device."""
    recipe = load_recipe(str(RECIPES / "tiny" / "qwen3_moe_tiny.yaml"), ["train.optimizer_offload=full"])
    layout = validate_recipe(recipe, world_size=2)
    plan = plan_recipe(recipe, layout, device_type=device_type)
    assert (plan.fsdp.parameters_on_host, plan.fsdp.pin_host_memory) == (True, pinned)
    assert "sharded parameters + gradients + optimizer on host" in plan.summary_lines()[1]
    for policy in ("none", "states"):
        other = plan_recipe(
            dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, optimizer_offload=policy)),
            layout,
            device_type=device_type,
        )
        assert not other.fsdp.parameters_on_host and "on host" not in other.summary_lines()[1]
