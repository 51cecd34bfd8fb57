"""Every kernel a run uses, decided once: ``resolve_kernels`` is the only place an ``auto`` kernel is resolved.

Inputs: the recipe's ``backend`` section, ``model.moe.experts_impl`` and ``router_gemm``, the run's device type
and compute dtype, the context-parallel layout (ring CP always runs the recurrent mixers' torch ops) and which
optional packages import here. Output: a ``KernelPlan``, one typed ``Chosen`` per kernel with the reason ``auto``
gave (``auto: cpu float32``). The run builds the model with the experts impl and router GEMM it names
(``build_model(..., experts_impl=, router_gemm=)``: a kernel is chosen when the plan is made, never swapped in
after the fact); the parallel plan stores it (``ParallelPlan.kernels``), derives each block's kernel labels from
it, and ``apply_kernels`` installs the ops it names. Nothing reads a choice back from a module, and nothing writes
one into the recipe: the recipe keeps what the user wrote (``auto`` included), the plan says what runs; the dry
run's CPU stand-ins for CUDA-only kernels are one declared table applied to the plan (``simulate.stand_ins``).

Why one place: a choice resolved where each kernel's module lives, again in the rules and again in the trainer,
can disagree with itself (the attention kernel the plan prints vs. the one the model runs), and a choice read back
from a module (``getattr(experts, "impl", "?")``) prints ``?`` for a model that was built another way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import torch

from nemo_ac.config import mixer_kernels as mixer_facts  # the packages each kernel needs (module: patchable)
from nemo_ac.config.schema import BackendConfig, ModelConfig, RecipeConfig
from nemo_ac.models import model_dtype
from nemo_ac.models.kernels.flex_attention import flex_attention_available
from nemo_ac.models.layers.experts import ExpertsImpl, grouped_mm_supported

AttentionKernel = Literal["sdpa", "tiled", "flex", "te"]
LinearAttentionKernel = Literal["torch", "fla"]
MambaKernel = Literal["torch", "mamba_ssm"]
ModuleKernel = Literal["torch", "te"]  # backend.linear / backend.rms_norm
Dispatcher = Literal["torch", "deepep"]
RouterGemm = Literal["param", "float32", "bf16x3"]  # param: the router runs in the parameter dtype (no fp32 GEMM)

T = TypeVar("T", bound=str)


@dataclass(frozen=True)
class Chosen(Generic[T]):
    """One kernel: its value and why. ``reason``: ``set`` (the recipe named it) or ``auto: ...`` (what auto saw).
    ``fallback``: auto took the torch op on a device the kernel runs on (a reader would ask why: the block label
    says it)."""

    value: T
    reason: str = "set"
    fallback: bool = False

    def describe(self) -> str:
        return f"{self.value} ({self.reason})"


@dataclass(frozen=True)
class KernelPlan:
    """The run's kernels (``backend.*`` and ``model.moe.experts_impl`` with ``auto`` resolved)."""

    experts: Chosen[ExpertsImpl]
    attention: Chosen[AttentionKernel]
    linear_attention: Chosen[LinearAttentionKernel]
    mamba: Chosen[MambaKernel]
    linear: Chosen[ModuleKernel]
    rms_norm: Chosen[ModuleKernel]
    dispatcher: Chosen[Dispatcher]
    router: Chosen[RouterGemm] = Chosen("param")

    def te_keys(self) -> tuple[str, ...]:
        """The ``backend.*`` keys set to te (each swaps Dynamo-disabled Transformer Engine modules into blocks)."""
        return tuple(
            f"backend.{key}"
            for key, chosen in (("linear", self.linear), ("rms_norm", self.rms_norm), ("attention", self.attention))
            if chosen.value == "te"
        )

    def slots_used(self, *, mixers: Collection[str], moe: bool) -> tuple[str, ...]:
        """The slots (field names) a model with these sequence-mixer kinds (``SequenceMixer.mixer_kind``) and, if
        ``moe``, a routed MoE runs, in field order: a mixer's kernel only where that mixer is, the experts and the
        dispatcher only with a MoE, the router's GEMM with a MoE whose router is fp32; the TE-swappable modules
        (``linear``, ``rms_norm``) are in every model."""
        used = {"linear", "rms_norm"} | {MIXER_SLOTS[kind] for kind in mixers if kind in MIXER_SLOTS}
        if moe:
            used |= {"experts", "dispatcher"} | ({"router"} if self.router.value != "param" else set())
        return tuple(field.name for field in dataclasses.fields(self) if field.name in used)

    def summary_line(self, slots: Collection[str] | None = None) -> str:
        """The ``kernels | ...`` line the run prints at start: the ``slots`` given (``slots_used``; the plan passes
        the model's), or every slot."""
        names = [field.name for field in dataclasses.fields(self)]
        unknown = set(slots or ()) - set(names)
        if unknown:
            raise ValueError(f"no KernelPlan slot {sorted(unknown)}; slots are {names}")
        shown = [name for name in names if slots is None or name in slots]
        return "kernels | " + " | ".join(f"{name} {getattr(self, name).describe()}" for name in shown)


# SequenceMixer.mixer_kind -> the KernelPlan slot that runs its core.
MIXER_SLOTS = {"softmax_attention": "attention", "linear_attention": "linear_attention", "ssm": "mamba"}


def choose_experts_impl(
    requested: Literal["auto", "loop", "grouped_mm"],
    *,
    device_type: str,
    dtype: torch.dtype,
    hidden_size: int,
    intermediate_size: int,
) -> ExpertsImpl:
    """``model.moe.experts_impl`` resolved for the device and compute dtype: ``auto`` is ``grouped_mm`` where it
    is supported (``grouped_mm_supported``) and ``loop`` elsewhere; an explicit choice is returned as it is
    (validation rejects an unsupported explicit ``grouped_mm`` before any process group starts)."""
    if requested != "auto":
        return requested
    supported = grouped_mm_supported(
        device_type=device_type, dtype=dtype, hidden_size=hidden_size, intermediate_size=intermediate_size
    )
    return "grouped_mm" if supported else "loop"


def choose_router_gemm(
    requested: Literal["auto", "float32", "bf16x3"], *, router_dtype: str, device_type: str, param_dtype: str
) -> Chosen[RouterGemm]:
    """``model.moe.router_gemm`` for an fp32 router (``router_dtype: float32``): ``auto`` is ``bf16x3`` on CUDA
    with bf16 compute (the hidden states are bf16, so three bf16 GEMMs give the fp32 GEMM's result:
    ``models.kernels.bf16x3_linear``), ``float32`` elsewhere (on a CPU the split computes the same products in
    fp32 matmuls, three times over). ``param`` when the router runs in the parameter dtype."""
    if router_dtype != "float32":
        return Chosen("param")
    if requested != "auto":
        return Chosen(requested)
    if device_type == "cuda" and param_dtype == "bfloat16":
        return Chosen("bf16x3", "auto: cuda bfloat16")
    return Chosen("float32", f"auto: {device_type} {param_dtype}")


def choose_attention_kernel(requested: str, *, device_type: str) -> AttentionKernel:
    """``backend.attention: auto`` -> flex on CUDA (when torch has FlexAttention), tiled elsewhere; others as set."""
    if requested != "auto":
        return requested  # type: ignore[return-value]
    return "flex" if device_type == "cuda" and flex_attention_available() else "tiled"


def resolve_mixer_kernel(
    kind: str, requested: str, *, device_type: str, cp: int, cp_type: str, assume_installed: bool = False
) -> Chosen[str]:
    """``backend.<kind>`` (linear_attention | mamba): the kernel the plan installs. ``auto`` takes the GPU kernel
    where the device is CUDA and its packages import (``config.mixer_kernels``), the torch op elsewhere and under
    ring CP (which passes the recurrent state through the torch op's initial / final state).
    ``assume_installed``: as on a CUDA node that has the packages (the full-size dry run plans for one)."""
    if requested != "auto":
        return Chosen(requested)
    if cp > 1 and cp_type == "ring":
        return Chosen("torch", "auto: ring CP passes the torch op's state", fallback=True)
    if device_type != "cuda":
        return Chosen("torch", f"auto: {device_type}")
    missing = () if assume_installed else mixer_facts.missing_modules(kind)
    if missing:
        return Chosen("torch", f"auto: {', '.join(missing)} not installed", fallback=True)
    return Chosen(mixer_facts.MIXER_KERNELS[kind].kernel, "auto: cuda")


def resolve_kernels(
    *,
    model: ModelConfig,
    backend: BackendConfig,
    device_type: str,
    param_dtype: str,
    cp: int = 1,
    cp_type: str = "ulysses",
    assume_installed: bool = False,
) -> KernelPlan:
    """The run's ``KernelPlan`` (module docstring). ``param_dtype``: the compute dtype's name
    (``parallel.fsdp.param_dtype``). ``assume_installed``: ``auto`` mixer kernels as on a CUDA node that has their
    packages (``resolve_mixer_kernel``; the full-size dry run plans for one)."""
    moe = model.moe
    experts = choose_experts_impl(
        moe.experts_impl,
        device_type=device_type,
        dtype=model_dtype(param_dtype),
        hidden_size=moe.latent_size or model.hidden_size,
        intermediate_size=moe.moe_intermediate_size,
    )
    attention = choose_attention_kernel(backend.attention, device_type=device_type)

    def how(requested: str, basis: str) -> str:
        return f"auto: {basis}" if requested == "auto" else "set"

    mixers = {
        kind: resolve_mixer_kernel(
            kind,
            getattr(backend, kind),
            device_type=device_type,
            cp=cp,
            cp_type=cp_type,
            assume_installed=assume_installed,
        )
        for kind in ("linear_attention", "mamba")
    }
    return KernelPlan(
        experts=Chosen(experts, how(moe.experts_impl, f"{device_type} {param_dtype}")),
        attention=Chosen(attention, how(backend.attention, device_type)),
        linear_attention=mixers["linear_attention"],  # type: ignore[arg-type]
        mamba=mixers["mamba"],  # type: ignore[arg-type]
        linear=Chosen(backend.linear),
        rms_norm=Chosen(backend.rms_norm),
        dispatcher=Chosen(backend.dispatcher),
        router=choose_router_gemm(
            moe.router_gemm, router_dtype=moe.router_dtype, device_type=device_type, param_dtype=param_dtype
        ),
    )


def recipe_kernels(recipe: RecipeConfig, *, device_type: str, assume_installed: bool = False) -> KernelPlan:
    """``resolve_kernels`` for a recipe at its own CP layout."""
    return resolve_kernels(
        model=recipe.model,
        backend=recipe.backend,
        device_type=device_type,
        param_dtype=recipe.parallel.fsdp.param_dtype,
        cp=recipe.parallel.cp,
        cp_type=recipe.parallel.cp_type,
        assume_installed=assume_installed,
    )
