"""What ``backend.linear_attention`` and ``backend.mamba`` need: checked before any process group. ``auto`` is
resolved with every other kernel in ``distributed.plan.kernels``, from the facts kept here.

Two sequence-mixer cores have a kernel of their own on GPU besides nemo_ac's chunked torch op (the reference that
runs everywhere): Gated DeltaNet (``fla``: flash-linear-attention's ``causal_conv1d`` + ``chunk_gated_delta_rule``
over ``cu_seqlens``) and Mamba-2 (``mamba_ssm``: causal-conv1d's ``causal_conv1d_fn`` + mamba-ssm's
``mamba_chunk_scan_combined``, both over ``seq_idx``). Both are CUDA-only Triton / CUDA code.

- ``auto`` picks the kernel where the run's device is CUDA and the packages import, and the torch op elsewhere; under
  ``parallel.cp_type: ring`` (with cp > 1) always the torch op, since ring CP passes the recurrent state between
  ranks through the torch op's initial / final state.
- An explicit kernel is refused (the key, the reason, the fix) on ``dist.device: cpu`` (or ``auto`` with gloo, which
  resolves to cpu), under ring CP, and when its packages do not import on the machine that validates: plain
  ``nemo-ac validate`` reports that, so a recipe that names a kernel fails on a machine without it instead of at the
  first forward. On a login node without the packages, validate on a node of the training environment or use
  ``auto``. No visible GPU is reported by
  ``--check-env`` and by the trainer before ``init_process_group`` (a login node has none).
- fla is pure Python + Triton, so it is an extra (``nemo_ac[fla]``: fla-core; a CUDA torch ships triton).
  mamba-ssm and causal-conv1d compile CUDA extensions and cannot even produce their metadata without nvcc, so they
  are no extra; the error gives the build line.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from nemo_ac.config.errors import ConfigIssue
from nemo_ac.config.schema import RecipeConfig


@dataclass(frozen=True)
class MixerKernel:
    """One mixer core's GPU kernel: its config key and value, the modules it imports, how to install them."""

    key: str  # backend.linear_attention | backend.mamba
    kernel: str  # the value that asks for it
    mixer: str  # for messages
    modules: tuple[str, ...]
    install: str


FLA_INSTALL = (
    "pip install 'nemo_ac[fla]' (flash-linear-attention's fla-core, pure Python + Triton; on a CUDA build of torch, "
    "which ships triton)"
)
MAMBA_INSTALL = (
    "mamba-ssm and causal-conv1d compile CUDA extensions, so they are no nemo_ac extra: on the CUDA machine (nvcc and a "
    "CUDA build of torch) pip install --no-build-isolation causal-conv1d mamba-ssm"
)

MIXER_KERNELS: dict[str, MixerKernel] = {
    "linear_attention": MixerKernel(
        key="backend.linear_attention",
        kernel="fla",
        mixer="Gated DeltaNet",
        modules=("fla",),
        install=FLA_INSTALL,
    ),
    "mamba": MixerKernel(
        key="backend.mamba",
        kernel="mamba_ssm",
        mixer="Mamba-2",
        modules=("mamba_ssm", "causal_conv1d"),
        install=MAMBA_INSTALL,
    ),
}


def missing_modules(kind: str) -> tuple[str, ...]:
    """The kernel's modules that do not import here (find_spec only: importing fla would import triton)."""
    missing = []
    for module in MIXER_KERNELS[kind].modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    return tuple(missing)


def _requested(recipe: RecipeConfig) -> list[tuple[str, MixerKernel]]:
    backend = recipe.backend
    values = {"linear_attention": backend.linear_attention, "mamba": backend.mamba}
    return [(kind, spec) for kind, spec in MIXER_KERNELS.items() if values[kind] == spec.kernel]


def check_mixer_kernels(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    """An explicit mixer kernel: not on CPU, not under ring CP, and importable on this machine."""
    issues = []
    par = recipe.parallel
    for kind, spec in _requested(recipe):
        fix = f"set {spec.key}: torch (or auto)"
        dist = recipe.dist
        if dist.device == "cpu" or (dist.device == "auto" and dist.backend == "gloo"):
            where = "dist.device is cpu" if dist.device == "cpu" else "dist.backend gloo puts dist.device auto on cpu"
            issues.append(ConfigIssue(spec.key, f"{spec.kernel} runs {spec.mixer} on CUDA only and {where}; {fix}"))
        if par.cp > 1 and par.cp_type == "ring":
            issues.append(
                ConfigIssue(
                    spec.key,
                    f"{spec.kernel} is not used under parallel.cp_type: ring: ring CP passes the {spec.mixer} state "
                    f"between ranks through the torch op's initial / final state; {fix}, or parallel.cp_type: ulysses "
                    "(which runs the kernel on each rank's head shard)",
                )
            )
        missing = missing_modules(kind)
        if missing:
            issues.append(
                ConfigIssue(
                    spec.key,
                    f"{spec.kernel} needs {' and '.join(repr(m) for m in missing)}, which "
                    f"{'does' if len(missing) == 1 else 'do'} not import on this "
                    f"machine (validate checks the packages a recipe names; run it where the job's environment is "
                    f"installed). Install: {spec.install}. Or {fix}: auto takes the kernel where CUDA and the package "
                    "are present and the torch op elsewhere",
                )
            )
    return issues


def mixer_kernel_environment_issues(recipe: RecipeConfig, *, cuda_available: bool | None) -> list[ConfigIssue]:
    """This machine: an explicit mixer kernel needs a visible GPU (``cuda_available`` None: not asked). The packages
    are checked by ``check_mixer_kernels`` already."""
    if cuda_available is not False:
        return []
    return [
        ConfigIssue(
            spec.key,
            f"{spec.kernel} runs {spec.mixer}'s CUDA kernels and no GPU is visible here; run on CUDA devices, or set "
            f"{spec.key}: torch (or auto)",
        )
        for _, spec in _requested(recipe)
    ]
