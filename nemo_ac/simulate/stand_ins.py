"""What the dry run executes in place of what cannot run on this CPU: one declared table, applied to the plan.

The recipe keeps what the user wrote and the plan says what runs on the target device (``distributed.plan.kernels``,
``auto`` resolved as on a CUDA node with nemo_ac's optional GPU kernels installed). The dry run computes on the CPU
with fake tensors, so a CUDA-only kernel runs as its CPU counterpart of the same work: ``KERNEL_STAND_INS`` names
each (plan slot, the planned values it replaces, what runs, why the count is still the planned kernel's), and
``executed_kernels`` applies it to the plan's ``KernelPlan``. The rest is not a kernel and is said beside it
(``execution_recipe``): the device is the CPU, and torch.compile is not applied (the compiled blocks' ops are costed
at the bytes inductor's fusion leaves, ``simulate.fusion``).

The mixer kernels need no row: fla's and mamba-ssm's custom ops run here through their fake implementations
(``models.kernels``), so the planned op is the executed op. DeepEP's neither: nemo_ac's DeepEP dispatcher runs as
planned, its ``nemo_ac::deepep_*`` ops through their fake impls, with the sizes the routing assumption gives
(``DEEPEP_STAND_IN``, ``simulate.routing.AssumedRoutingDeepEP``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nemo_ac.config.hf import family_rules
from nemo_ac.config.schema import RecipeConfig
from nemo_ac.distributed.plan.kernels import Chosen, KernelPlan

# DeepEP's NVLink + RDMA buffers (deep_ep.Buffer, outside torch's allocator): DeepEP's tests size them at ~1 GB each
# for hidden 7168 in bf16; added by hand, as an assumption, when the recipe's dispatcher is deepep.
DEEPEP_BUFFER_BYTES = 2 * 2**30
DEEPEP_STAND_IN = (
    "dispatcher deepep -> the same, without DeepEP's kernels: nemo_ac's DeepEP dispatcher runs as in training (the "
    "expert-side permutation, weighting and combine, the nemo_ac::deepep_* ops selective AC saves), the ops through "
    "their fake impls: the tokens received and the rows per local expert from the routing assumption, the transfers "
    "costed as DeepEP sends them (a token once per destination rank over NVLink, once per destination node over "
    f"RDMA); DeepEP's own buffers added by hand: {DEEPEP_BUFFER_BYTES / 2**30:.0f} GiB"
)


@dataclass(frozen=True)
class KernelStandIn:
    """One row: where the plan's ``slot`` is one of ``planned``, the dry run executes ``executed``; ``same_work``
    says why the count stands for the planned kernel."""

    slot: str  # a KernelPlan field
    planned: frozenset[str]
    executed: str
    same_work: str


KERNEL_STAND_INS: tuple[KernelStandIn, ...] = (
    KernelStandIn(
        "attention",
        frozenset({"flex", "te"}),
        "tiled",
        "the same visible pairs; flex and te need CUDA",
    ),
    KernelStandIn("linear", frozenset({"te"}), "torch", "Transformer Engine Linear: the same GEMMs"),
    KernelStandIn("rms_norm", frozenset({"te"}), "torch", "Transformer Engine RMSNorm: the same norms"),
)


def executed_kernels(planned: KernelPlan) -> tuple[KernelPlan, list[str]]:
    """The kernels the dry run executes for ``planned`` (``KERNEL_STAND_INS`` applied) and one line per stand-in
    taken."""
    changes: dict[str, Chosen] = {}
    notes: list[str] = []
    for row in KERNEL_STAND_INS:
        chosen: Chosen = getattr(planned, row.slot)
        if chosen.value in row.planned:
            changes[row.slot] = Chosen(row.executed, f"dry-run stand-in for {chosen.value}")
            notes.append(f"{row.slot} {chosen.value} -> {row.executed}: {row.same_work}")
    return dataclasses.replace(planned, **changes), notes


def planned_gpu_kernel_notes(recipe: RecipeConfig, planned: KernelPlan) -> list[str]:
    """The assumption behind the model's ``auto`` mixer kernels on a GPU plan: resolved as on a CUDA node with the
    kernel installed (``recipe_kernels(..., assume_installed=True)``), said when one took a GPU kernel."""
    changes = [
        (mixer.backend_key, getattr(planned, mixer.backend_key).value)
        for mixer in family_rules(recipe.model.family).recurrent_mixers(recipe.model)
        if getattr(recipe.backend, mixer.backend_key) == "auto" and getattr(planned, mixer.backend_key).value != "torch"
    ]
    if not changes:
        return []
    named = ", ".join(f"backend.{key} auto -> {kernel}" for key, kernel in dict(changes).items())
    return [f"{named}, as on a CUDA node with the kernel installed (set backend.<key>=torch to plan without)"]


def execution_recipe(recipe: RecipeConfig, *, device_type: str) -> tuple[RecipeConfig, list[str]]:
    """The recipe as the dry run executes it on the CPU (gloo, no torch.compile), and the line each change takes."""
    notes: list[str] = []
    if device_type != "cpu":
        notes.append(f"device {device_type} -> cpu (fake tensors: no memory either way)")
    if recipe.compile.enabled:
        notes.append(
            "torch.compile not applied: the eager op stream runs; the compiled blocks' ops are costed at the bytes "
            "inductor's fusion leaves (simulate.fusion)"
        )
    executed = dataclasses.replace(
        recipe,
        compile=dataclasses.replace(recipe.compile, enabled=False),
        dist=dataclasses.replace(recipe.dist, device="cpu", backend="gloo"),
    )
    return executed, notes
