"""Hugging Face weights in the trainer: ``model.pretrained`` in, ``checkpoint.export_hf`` out.

Precedence: ``model.pretrained``'s config.json gives every architecture field the recipe does not set
(``nemo_ac.config.pretrained``, at load time, before any process group); ``check_hf_weights`` (the preflight's)
rejects recipe keys that would not fit its weights. A Hub id's downloaded config.json is compared with the recipe
again on every rank right after the download, before any weight is read (``architecture_issues``): the recipe may
have been filled from a shipped snapshot or a cached copy. Fields that change neither the weights nor the math
(``nemo_ac.config.pretrained.MAY_DIFFER``) may differ.

Export (``export_final_hf``) writes into ``.<dir>.partial`` and renames it over ``<dir>`` only when complete, so a
crash never leaves a directory that mixes two exports' shards; a failure removes the ``.partial`` and leaves the
previous export as it was. Tokenizer / processor files and generation_config.json come along
(``nemo_ac.trainer.checkpoint.export_files``), and ``nemo_ac_export.json`` marks the directory as an export, which a
later one may replace (``nemo_ac.trainer.checkpoint.export_target``: where an export may go; the preflight checks
``checkpoint.export_hf_dir`` against it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.hf import read_hf_config
from nemo_ac.config.pretrained import architecture_mismatches, check_pretrained, mismatch_issues
from nemo_ac.config.pretrained_files import local_pretrained_dir
from nemo_ac.config.schema import CheckpointConfig, ModelConfig, RecipeConfig
from nemo_ac.models import build_model, model_dtype
from nemo_ac.models.init import materialize_and_init
from nemo_ac.runtime import once_per_node
from nemo_ac.trainer.checkpoint.export_files import write_export_extras
from nemo_ac.trainer.checkpoint.export_target import EXPORT_MARKER, marker_text, partial_of, swap_in
from nemo_ac.trainer.checkpoint.files import root_of
from nemo_ac.trainer.checkpoint.hf_safetensors import (
    checkpoint_problems,
    export_hf_checkpoint,
    materialize_and_load,
    resolve_pretrained,
)

__all__ = [
    "architecture_issues",
    "architecture_mismatches",
    "check_hf_weights",
    "check_pretrained_tensors",
    "export_dir",
    "export_final_hf",
    "export_model_dir",
    "materialize_weights",
    "resolve_pretrained_once_per_node",
]


def architecture_issues(recipe_model: ModelConfig, path: str | Path) -> list[ConfigIssue]:
    """Mismatches between the recipe and ``path/config.json``, one ConfigIssue per key (empty: they agree)."""
    config_file = Path(path) / "config.json"
    try:
        checkpoint_model = read_hf_config(path)
    except (FileNotFoundError, NotImplementedError, ValueError, KeyError) as exc:
        return [ConfigIssue("model.pretrained", f"{config_file} cannot be read as a nemo_ac model: {exc}")]
    return mismatch_issues(recipe_model, checkpoint_model, str(config_file))


def check_hf_weights(recipe: RecipeConfig) -> list[ConfigIssue]:
    """Before any process group (pure; see ``nemo_ac.config.pretrained.check_pretrained``)."""
    return check_pretrained(recipe)


MAX_LISTED = 20  # tensor problems listed one per line; the rest counted


def check_pretrained_tensors(recipe: RecipeConfig) -> list[ConfigIssue]:
    """The preflight's environment step (imports torch, starts no process group): every tensor in a local
    ``model.pretrained``'s safetensors headers against the model built on the meta device, by the loader's own plan
    (``trainer.checkpoint.hf_safetensors.checkpoint_problems``: missing, unexpected, mis-shaped, mis-typed keys, in the
    words the load would use). Before, these failed only after the process group, the build and the parallelization, on
    the way into a weight load. A Hub id is skipped (no network here); the load checks its files after the download."""
    root = local_pretrained_dir(recipe)
    if root is None:
        return []
    problems = checkpoint_problems(build_model(recipe.model, device="meta"), root)
    if not problems:
        return []
    issues = [ConfigIssue("model.pretrained", problem) for problem in problems[:MAX_LISTED]]
    more = f" ({len(problems) - MAX_LISTED} more not listed)" if len(problems) > MAX_LISTED else ""
    issues.append(
        ConfigIssue(
            "model.pretrained",
            f"the safetensors in {root} do not fit the model its config.json describes{more}: export the checkpoint "
            "again, or point model.pretrained at one whose weights match its config.json",
        )
    )
    return issues


def resolve_pretrained_once_per_node(name_or_path: str) -> Path:
    """A local directory as is. A Hub id is downloaded by local rank 0 of each node while the node's other ranks
    wait at a barrier, then resolved from the filled cache by them (no rank reads before its node has the files;
    no node downloads the checkpoint once per rank)."""
    if Path(name_or_path).is_dir():
        return resolve_pretrained(name_or_path)
    return once_per_node(lambda: resolve_pretrained(name_or_path))


def materialize_weights(
    model: nn.Module,
    *,
    model_config: ModelConfig,
    device: torch.device,
    seed: int,
    parameter_device: torch.device | None = None,
) -> str:
    """``model.pretrained`` -> load its safetensors into the parallelized model; else deterministic random init.
    Returns what happened, for the startup line. Raises ConfigError when a downloaded checkpoint disagrees.
    ``parameter_device``: the host when the plan keeps FSDP's shards there (``FSDPPlan.parameters_on_host``)."""
    if not model_config.pretrained:
        materialize_and_init(model, device=device, seed=seed, parameter_device=parameter_device)
        return "random init"
    path = resolve_pretrained_once_per_node(model_config.pretrained)
    issues = architecture_issues(model_config, path)
    if issues:
        raise ConfigError(issues, source=str(path / "config.json"))
    materialize_and_load(model, path, device=device, parameter_device=parameter_device)
    return f"weights from {path}"


def export_dir(config: CheckpointConfig) -> Path:
    return Path(config.export_hf_dir) if config.export_hf_dir else root_of(config) / "hf"


def export_final_hf(model: nn.Module, *, config: CheckpointConfig, recipe: RecipeConfig | None = None) -> Path:
    """Collective (every rank calls): the consolidated HF checkpoint of ``model`` at ``export_dir(config)``, with
    the tokenizer files and generation_config.json of ``recipe`` (when given)."""
    dtype = model_dtype(config.export_dtype) if config.export_dtype else None
    return export_model_dir(model, export_dir(config), dtype=dtype, recipe=recipe, source="end of training")


def export_model_dir(
    model: nn.Module,
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    recipe: RecipeConfig | None = None,
    source: str | None = None,
    step: int | None = None,
) -> Path:
    """Collective: ``model`` as an HF model directory at ``out``, written into ``.<out>.partial`` and swapped in
    only when complete (``export_target.swap_in``). Rank 0 adds ``write_export_extras(recipe)`` (tokenizer,
    generation config) and the export marker (``source``, ``step``). Any failure, an interrupt included, removes
    the ``.partial`` and leaves a previous export at ``out`` untouched. Where ``out`` may be is the callers'
    check (``export_target``), made before anything is loaded."""
    partial = partial_of(out)
    main = not dist.is_initialized() or dist.get_rank() == 0
    try:
        if main:
            shutil.rmtree(partial, ignore_errors=True)
            partial.parent.mkdir(parents=True, exist_ok=True)
        if dist.is_initialized():
            dist.barrier()
        export_hf_checkpoint(model, partial, dtype=dtype)  # rank 0 writes; ends with a barrier
        if main:
            if recipe is not None:
                for line in write_export_extras(recipe, partial):
                    print(f"export | {line}", flush=True)
            (partial / EXPORT_MARKER).write_text(marker_text(source=source, step=step))
            swap_in(partial, out)
    except BaseException:
        if main:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier()
    return out
