"""Hugging Face weights in the trainer: ``model.pretrained`` in, ``checkpoint.export_hf`` out.

Precedence: the recipe's ``model.*`` fields build the model; ``model.pretrained`` only supplies weights. A local
directory's ``config.json`` is read before any process group starts and every architecture field that changes
the weights or the math must agree with the recipe (``architecture_issues`` lists each mismatching key with both
values); a Hub id is checked the same way right after it is downloaded, on every rank, before any weight is read.
Fields that change neither (``max_position_embeddings``, ``init_std``, Mamba's ``chunk_size`` and dt-init range)
and training knobs (``moe.aux_loss_coef``, ``moe.bias_update_rate``, ``moe.router_dtype``,
``moe.separate_fsdp_unit``, the kernel choice ``moe.experts_impl``) may differ.

Export (``export_final_hf``) writes into ``<dir>.partial`` and renames it over ``<dir>`` only when complete, so a
crash never leaves a directory that mixes two exports' shards.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.schema import CheckpointConfig, ModelConfig, RecipeConfig
from nemo_ac.models import model_dtype
from nemo_ac.models.hf import (
    HF_FAMILIES,
    export_hf_checkpoint,
    materialize_and_load,
    read_hf_config,
    resolve_pretrained,
)
from nemo_ac.models.init import materialize_and_init
from nemo_ac.trainer.checkpoint_files import root_of

# ModelConfig fields (dotted below model.) that neither shape a weight nor change the forward math.
IGNORED_FIELDS = frozenset(
    {
        "pretrained",
        "max_position_embeddings",
        "init_std",
        "moe.aux_loss_coef",
        "moe.bias_update_rate",
        "moe.router_dtype",
        "moe.separate_fsdp_unit",
        "moe.experts_impl",
        "mamba.chunk_size",
        "mamba.expand",
        "mamba.time_step_max",
        "mamba.time_step_floor",
        "linear_attention.chunk_size",
    }
)
# Sections only one family reads; elsewhere they keep their defaults and are not compared.
_FAMILY_SECTIONS = {"mamba": "nemotron_h", "linear_attention": "qwen3_5_moe", "vision": "qwen3_5_moe"}


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if dataclasses.is_dataclass(value):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            out.update(_flatten(getattr(value, f.name), f"{prefix}{f.name}."))
        return out
    return {prefix.rstrip("."): value}


def architecture_mismatches(recipe_model: ModelConfig, checkpoint_model: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(key under model., recipe value, checkpoint value) for every compared field that differs."""
    ours, theirs = _flatten(recipe_model), _flatten(checkpoint_model)
    out = []
    for key, value in ours.items():
        section = key.split(".", 1)[0]
        if key in IGNORED_FIELDS or _FAMILY_SECTIONS.get(section, recipe_model.family) != recipe_model.family:
            continue
        if key in theirs and theirs[key] != value:
            out.append((key, value, theirs[key]))
    return out


def architecture_issues(recipe_model: ModelConfig, path: str | Path) -> list[ConfigIssue]:
    """Mismatches between the recipe and ``path/config.json``, one ConfigIssue per key (empty: they agree)."""
    config_file = Path(path) / "config.json"
    try:
        checkpoint_model = read_hf_config(path)
    except (NotImplementedError, ValueError, KeyError) as exc:
        return [ConfigIssue("model.pretrained", f"{config_file} cannot be read as a nemo_ac model: {exc}")]
    return [
        ConfigIssue(
            f"model.{key}",
            f"recipe says {ours!r} but {config_file} says {theirs!r}; the recipe builds the model and the checkpoint "
            f"must fit it: set model.{key}: {theirs!r} (or point model.pretrained at a matching checkpoint)",
        )
        for key, ours, theirs in architecture_mismatches(recipe_model, checkpoint_model)
    ]


def _looks_like_hub_id(name: str) -> bool:
    """``org/name`` (or ``name``): no leading ``/ . ~`` and at most one ``/``; anything else is a local path."""
    return not name.startswith(("/", ".", "~")) and name.count("/") <= 1


def check_hf_weights(recipe: RecipeConfig) -> list[ConfigIssue]:
    """Before any process group: a local ``model.pretrained`` must hold config.json and agree with the recipe; a
    family must have an HF mapping to load or export. A Hub id (not a local directory) is checked after download."""
    issues = []
    family = recipe.model.family
    mapped = any(spec.family == family for spec in HF_FAMILIES.values())
    asks = {"model.pretrained": bool(recipe.model.pretrained), "checkpoint.export_hf": recipe.checkpoint.export_hf}
    wants = [key for key, on in asks.items() if on]
    if wants and not mapped:
        for key in wants:
            issues.append(ConfigIssue(key, f"model.family {family!r} has no Hugging Face weight mapping"))
        return issues
    pretrained = recipe.model.pretrained
    if pretrained and not Path(pretrained).is_dir() and not _looks_like_hub_id(pretrained):
        return [ConfigIssue("model.pretrained", f"{pretrained} is not a directory (nor a Hub id like org/name)")]
    if pretrained and Path(pretrained).is_dir():
        if not (Path(pretrained) / "config.json").is_file():
            return [ConfigIssue("model.pretrained", f"{pretrained} is a directory without config.json")]
        issues += architecture_issues(recipe.model, pretrained)
    return issues


def resolve_pretrained_once_per_node(name_or_path: str) -> Path:
    """A local directory as is. A Hub id is downloaded by local rank 0 of each node while the node's other ranks
    wait at a barrier, then resolved from the filled cache by them (no rank reads before its node has the files;
    no node downloads the checkpoint once per rank)."""
    if Path(name_or_path).is_dir() or not (dist.is_available() and dist.is_initialized()):
        return resolve_pretrained(name_or_path)
    path, error = None, None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            path = resolve_pretrained(name_or_path)
        except FileNotFoundError as err:  # still reach the barrier: the node's other ranks wait there
            error = err
    dist.barrier()
    if error is not None:
        raise error
    return path if path is not None else resolve_pretrained(name_or_path)


def materialize_weights(model: nn.Module, *, model_config: ModelConfig, device: torch.device, seed: int) -> str:
    """``model.pretrained`` -> load its safetensors into the parallelized model; else deterministic random init.
    Returns what happened, for the startup line. Raises ConfigError when a downloaded checkpoint disagrees."""
    if not model_config.pretrained:
        materialize_and_init(model, device=device, seed=seed)
        return "random init"
    path = resolve_pretrained_once_per_node(model_config.pretrained)
    issues = architecture_issues(model_config, path)
    if issues:
        raise ConfigError(issues, source=str(path / "config.json"))
    materialize_and_load(model, path, device=device)
    return f"weights from {path}"


def export_dir(config: CheckpointConfig) -> Path:
    return Path(config.export_hf_dir) if config.export_hf_dir else root_of(config) / "hf"


def export_final_hf(model: nn.Module, *, config: CheckpointConfig) -> Path:
    """Collective (every rank calls): the consolidated HF checkpoint of ``model`` at ``export_dir(config)``."""
    out = export_dir(config)
    partial = out.with_name(f".{out.name}.partial")
    old = out.with_name(f".{out.name}.old")
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dtype = model_dtype(config.export_dtype) if config.export_dtype else None
    export_hf_checkpoint(model, partial, dtype=dtype)  # rank 0 writes; ends with a barrier
    if main:
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return out
