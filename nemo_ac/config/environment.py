"""Optional extras and devices a recipe needs: checked before ``init_process_group`` by the trainer and on demand by
``nemo-ac validate --check-env``. A missing extra fails with the key and the ``pip install`` line (DeepEP, which no
pip extra installs: the key and how to build it, ``config.deepep``)."""

from __future__ import annotations

import importlib.util

from nemo_ac.config.deepep import deepep_environment_issues
from nemo_ac.config.errors import ConfigIssue
from nemo_ac.config.mixer_kernels import mixer_kernel_environment_issues
from nemo_ac.config.schema import RecipeConfig

_EXTRAS = {
    ("backend.attention", "te"): ("transformer_engine", "te"),
    ("backend.linear", "te"): ("transformer_engine", "te"),
    ("backend.rms_norm", "te"): ("transformer_engine", "te"),
}


def check_environment(recipe: RecipeConfig, *, cuda_available: bool | None = None) -> list[ConfigIssue]:
    """Optional extras and devices the recipe needs but this machine lacks (empty list: all present)."""
    issues = []
    values = {
        "backend.attention": recipe.backend.attention,
        "backend.linear": recipe.backend.linear,
        "backend.rms_norm": recipe.backend.rms_norm,
    }
    for (key, value), (module, extra) in _EXTRAS.items():
        if values[key] == value and importlib.util.find_spec(module) is None:
            issues.append(
                ConfigIssue(
                    key,
                    f"{value!r} needs the optional package '{module}', which is not installed: "
                    f"pip install 'nemo_ac[{extra}]' on a CUDA machine, or set {key}: "
                    f"{'torch' if key != 'backend.attention' else 'sdpa'}",
                )
            )
    if recipe.model.pretrained and importlib.util.find_spec("safetensors") is None:
        issues.append(
            ConfigIssue("model.pretrained", "loading HF weights needs 'safetensors': pip install 'nemo_ac[hf]'")
        )
    if recipe.backend.attention == "flex" and cuda_available is False:
        issues.append(
            ConfigIssue(
                "backend.attention",
                "'flex' (FlexAttention) trains only on CUDA (torch's CPU lowering has no backward and no log-sum-exp); "
                "use backend.attention: tiled (or auto) here",
            )
        )
    issues += deepep_environment_issues(recipe, cuda_available=cuda_available)  # deep_ep and a GPU
    issues += _metrics_backend_issues(recipe)
    issues += mixer_kernel_environment_issues(recipe, cuda_available=cuda_available)  # fla / mamba_ssm: a GPU
    needs_cuda = "te" in values.values() or recipe.dist.backend == "nccl"
    if needs_cuda and cuda_available is False:
        issues.append(
            ConfigIssue(
                "backend" if recipe.dist.backend != "nccl" else "dist.backend",
                "this recipe needs CUDA (te / nccl) but no GPU is visible",
            )
        )
    return issues


def _metrics_backend_issues(recipe: RecipeConfig) -> list[ConfigIssue]:
    """The metrics backends beside JSONL: each needs its optional package on rank 0 (checked on every rank, before
    the process group, so a run never trains for hours and then fails to write its first record)."""
    issues = []
    if recipe.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        issues.append(
            ConfigIssue(
                "logging.tensorboard",
                "true needs the optional package 'tensorboard', which is not installed: "
                "pip install 'nemo_ac[tensorboard]', or set logging.tensorboard: false",
            )
        )
    if recipe.logging.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        issues.append(
            ConfigIssue(
                "logging.wandb.mode",
                f"{recipe.logging.wandb.mode!r} needs the optional package 'wandb', which is not installed: "
                "pip install 'nemo_ac[wandb]', or set logging.wandb.mode: disabled",
            )
        )
    return issues
