"""The dry run's stand-ins for CUDA-only kernels are one declared table applied to the plan's ``KernelPlan``: the
planned kernel stays in the plan (and the recipe keeps what the user wrote); what executes on the CPU is the table's
row, said once per stand-in."""

from __future__ import annotations

import dataclasses

from nemo_ac.config import load_recipe
from nemo_ac.distributed.plan import Chosen, KernelPlan, recipe_kernels
from nemo_ac.simulate.stand_ins import KERNEL_STAND_INS, executed_kernels, planned_gpu_kernel_notes
from tests.launch import RECIPES

NEMOTRON = RECIPES / "nemotron_super_v3_te_deepep.yaml"


def gpu_kernels() -> KernelPlan:
    """What a CUDA node with every optional package resolves for the Nemotron flagship (TE, DeepEP, mamba-ssm)."""
    recipe = load_recipe(str(NEMOTRON))
    return recipe_kernels(recipe, device_type="cuda", assume_installed=True)


def test_every_row_names_a_slot_and_executes_a_kernel_with_no_stand_in_of_its_own() -> None:
    slots = {field.name for field in dataclasses.fields(KernelPlan)}
    for row in KERNEL_STAND_INS:
        assert row.slot in slots, row
        replaced = {value for other in KERNEL_STAND_INS if other.slot == row.slot for value in other.planned}
        assert row.executed not in replaced, row  # a stand-in never needs a stand-in itself


def test_cuda_only_kernels_execute_as_their_cpu_counterparts_and_are_said() -> None:
    planned = dataclasses.replace(gpu_kernels(), attention=Chosen("flex", "auto: cuda"))
    assert (planned.linear.value, planned.rms_norm.value, planned.dispatcher.value) == ("te", "te", "deepep")
    executed, notes = executed_kernels(planned)
    assert (executed.attention.value, executed.linear.value, executed.rms_norm.value, executed.dispatcher.value) == (
        "tiled",
        "torch",
        "torch",
        "deepep",  # nemo_ac's DeepEP dispatcher runs; its ops through their fake impls (test_deepep_layout.py)
    )
    assert [note.split(":", 1)[0] for note in notes] == [
        "attention flex -> tiled",
        "linear te -> torch",
        "rms_norm te -> torch",
    ]
    # Kernels with no row (the experts, the mixers' custom ops: fake implementations run here) execute as planned.
    assert (executed.experts, executed.mamba, executed.linear_attention) == (
        planned.experts,
        planned.mamba,
        planned.linear_attention,
    )


def test_a_plan_with_nothing_cuda_only_executes_unchanged() -> None:
    planned = recipe_kernels(load_recipe(str(RECIPES / "tiny" / "qwen3_6_medpix_tiny.yaml")), device_type="cpu")
    assert executed_kernels(planned) == (planned, [])


def test_auto_mixer_kernels_are_planned_as_installed_and_the_assumption_is_said() -> None:
    recipe = load_recipe(str(NEMOTRON), ["backend.mamba=auto"])
    planned = recipe_kernels(recipe, device_type="cuda", assume_installed=True)
    assert planned.mamba == Chosen("mamba_ssm", "auto: cuda")
    assert recipe.backend.mamba == "auto"  # the recipe keeps what the user wrote
    assert planned_gpu_kernel_notes(recipe, planned) == [
        "backend.mamba auto -> mamba_ssm, as on a CUDA node with the kernel installed (set backend.<key>=torch to "
        "plan without)"
    ]
    torch_mamba = load_recipe(str(NEMOTRON), ["backend.mamba=torch"])
    assert planned_gpu_kernel_notes(torch_mamba, recipe_kernels(torch_mamba, device_type="cuda")) == []
