"""HF-first models: ``model.pretrained`` fills every ``model.*`` architecture field from the checkpoint's config.json.

A recipe that says ``model.pretrained: org/name`` (or a local directory) needs no architecture block: loading reads
the checkpoint's ``config.json`` through the family mapping (``nemo_ac.config.hf``) and uses its values for every
field it describes. Keys the recipe (YAML or a ``key=value`` override) sets explicitly win, with one note per key
whose value differs ("model.num_layers: recipe 4 overrides config.json 40"); schema defaults never override.
Training and kernel choices that no config.json holds (``NOT_FROM_CONFIG``) keep the recipe's value or the default.

Where ``config.json`` comes from, in order, all before any process group and without torch:

1. a local directory (``model.pretrained: /path/to/model``): its ``config.json``;
2. a Hub id with a snapshot shipped in ``recipes/hf_configs/<org>/<name>/config.json`` (the flagship models: recipes
   validate offline, in CI, on a login node);
3. a Hub id in the local Hugging Face cache (``huggingface_hub``, no network);
4. a Hub id downloaded (``config.json`` only; skipped with ``HF_HUB_OFFLINE=1``).

Otherwise loading fails with ``model.pretrained`` and what would work. After the weights are downloaded the trainer
compares their ``config.json`` with the recipe again (``architecture_issues``), so a snapshot that went stale fails
with the keys that differ, never trains a model that does not fit its weights.

A recipe key that changes a weight's shape or the math (anything outside ``MAY_DIFFER``) cannot override the
checkpoint it loads: ``check_pretrained`` rejects it naming the key (remove it, its value then comes from
config.json). Overrides of ``MAY_DIFFER`` fields (router dtype, kernel chunk sizes, ``max_position_embeddings``, ...)
are the point of keeping them in a recipe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.hf import FAMILY_RULES, HF_FAMILIES, family_rules, read_hf_config_dict
from nemo_ac.config.recipes import recipes_root
from nemo_ac.config.schema import ModelConfig, RecipeConfig

SNAPSHOTS = "hf_configs"  # under the shipped recipes/ directory
# ModelConfig fields (dotted below model.) no config.json describes: the recipe's value or the schema default.
NOT_FROM_CONFIG = frozenset(
    {
        "pretrained",
        "moe.aux_loss_coef",
        "moe.bias_update_rate",
        "moe.separate_fsdp_unit",
        "moe.experts_impl",
        "moe.router_gemm",
        "linear_attention.chunk_size",
    }
)
# Fields that neither shape a weight nor change the forward math: a recipe may set them to other values than the
# checkpoint's config.json (training knobs, kernel chunk sizes, init of weights that are loaded anyway).
MAY_DIFFER = NOT_FROM_CONFIG | {
    "max_position_embeddings",
    "init_std",
    "moe.router_dtype",
    "mamba.chunk_size",
    "mamba.expand",
    "mamba.time_step_max",
    "mamba.time_step_floor",
}


@dataclass(frozen=True)
class PretrainedConfig:
    """The ``config.json`` behind a ``model.pretrained`` value and what the family mapping reads from it."""

    name: str  # as the recipe says
    source: str  # where config.json was read (a path, naming the snapshot or cache it sits in)
    config: dict[str, Any]
    model: ModelConfig


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` (or ``name``) in the Hub's alphabet (letters, digits, ``- _ .``); anything else is a path."""
    return bool(_HUB_ID.match(name))


def snapshot_path(name: str) -> Path:
    """Where a shipped ``config.json`` snapshot of Hub id ``name`` lives (it may not exist)."""
    return recipes_root() / SNAPSHOTS / name / "config.json"


def _cached(name: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # a name the Hub's validators reject is in no cache
        return None
    return Path(found) if isinstance(found, str) else None


def _download(name: str) -> tuple[Path | None, str]:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return None, "HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None, "huggingface_hub is not installed (pip install 'nemo_ac[hf]')"
    try:
        return Path(hf_hub_download(name, "config.json")), ""
    except Exception as exc:  # offline, unknown or gated repo: all mean "not available here"
        return None, f"download failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def find_config_json(name: str) -> tuple[Path, str]:
    """(config.json path, where it came from) for a ``model.pretrained`` value; ``ConfigError`` naming the key."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(ConfigIssue("model.pretrained", f"{name} is a directory without config.json"))
        return path / "config.json", str(path / "config.json")
    if not looks_like_hub_id(name):
        raise ConfigError(ConfigIssue("model.pretrained", f"{name} is not a directory (nor a Hub id like org/name)"))
    snapshot = snapshot_path(name)
    if snapshot.is_file():
        return snapshot, f"recipes/{SNAPSHOTS}/{name}/config.json (shipped snapshot)"
    cached = _cached(name)
    if cached is not None:
        return cached, f"{cached} (Hugging Face cache)"
    downloaded, why = _download(name)
    if downloaded is not None:
        return downloaded, f"{downloaded} (downloaded)"
    raise ConfigError(
        ConfigIssue(
            "model.pretrained",
            f"the config.json of Hub id {name!r} is not available here: no local directory of that name, no shipped "
            f"snapshot ({snapshot}), not in the Hugging Face cache, and {why}. Download it (huggingface-cli download "
            f"{name} config.json), point model.pretrained at a local model directory, or add a snapshot",
        )
    )


def load_pretrained_config(name: str) -> PretrainedConfig:
    """The ``config.json`` of ``name`` read through its family mapping; ``ConfigError`` on ``model.pretrained``."""
    file, source = find_config_json(name)
    try:
        config = json.loads(file.read_text())
        model = read_hf_config_dict(config, source=str(file))
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        problem = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError(
            ConfigIssue("model.pretrained", f"{source} cannot be read as a nemo_ac model: {problem}")
        ) from exc
    return PretrainedConfig(name=name, source=source, config=config, model=model)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a (nested) dataclass or mapping; lists are leaves."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict) and (value or not prefix):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _deep_update(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_update(out[key], value)
        else:
            out[key] = value
    return out


def _family_reads(key: str, family: str) -> bool:
    """Sections a family declares as its own (``FamilyRules.sections``) are read by that family alone; elsewhere
    they keep their defaults and are neither noted nor compared."""
    section = key.split(".", 1)[0]
    owned = any(section in rules.sections for rules in FAMILY_RULES.values())
    return not owned or section in family_rules(family).sections


def fill_model_section(model: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """The recipe's ``model`` mapping (what the user wrote, before schema defaults) with every field the
    ``model.pretrained`` config.json describes filled in; explicit keys win, one line in ``notes`` per key whose
    value differs from config.json's. A mapping without ``pretrained`` is returned unchanged."""
    name = model.get("pretrained")
    if not name or not isinstance(name, str):
        return model
    pretrained = load_pretrained_config(name)
    family = pretrained.model.family
    if model.get("family") not in (None, family):
        raise ConfigError(
            ConfigIssue(
                "model.family",
                f"the recipe says {model['family']!r} but {pretrained.source} is model_type "
                f"{pretrained.config.get('model_type')!r} (family {family!r}): remove model.family (it comes from "
                "config.json) or point model.pretrained at a checkpoint of that family",
            )
        )
    base = {k: v for k, v in flatten(pretrained.model).items() if k not in NOT_FROM_CONFIG}
    explicit = flatten(model)
    overridden = [
        key
        for key, value in explicit.items()
        if key in base and key != "family" and _family_reads(key, family) and value != base[key]
    ]
    if notes is not None:
        notes.append(
            f"model.pretrained: architecture from {pretrained.source} (family {family}); "
            + (f"{len(overridden)} key(s) overridden by the recipe" if overridden else "no recipe overrides")
        )
        notes += [f"model.{key}: recipe {explicit[key]!r} overrides config.json {base[key]!r}" for key in overridden]
    return _deep_update(_unflatten(base), model)


def architecture_mismatches(recipe_model: ModelConfig, checkpoint_model: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(key under model., recipe value, checkpoint value) for every compared field that differs."""
    ours, theirs = flatten(recipe_model), flatten(checkpoint_model)
    return [
        (key, value, theirs[key])
        for key, value in ours.items()
        if key not in MAY_DIFFER and _family_reads(key, recipe_model.family) and key in theirs and theirs[key] != value
    ]


def mismatch_issues(recipe_model: ModelConfig, checkpoint_model: ModelConfig, source: str) -> list[ConfigIssue]:
    """One ConfigIssue per field the recipe sets to another value than the checkpoint it loads."""
    return [
        ConfigIssue(
            f"model.{key}",
            f"recipe says {ours!r} but {source} says {theirs!r}; the weights of model.pretrained have the checkpoint's "
            f"shape and math: remove model.{key} from the recipe (it then comes from config.json) or set "
            f"model.{key}: {theirs!r}",
        )
        for key, ours, theirs in architecture_mismatches(recipe_model, checkpoint_model)
    ]


def check_pretrained(recipe: RecipeConfig) -> list[ConfigIssue]:
    """Before any process group: ``model.pretrained``'s config.json is readable and the recipe's architecture fits
    it; a family must have an HF mapping to load or export."""
    family = recipe.model.family
    mapped = any(spec.family == family for spec in HF_FAMILIES.values())
    asks = {"model.pretrained": bool(recipe.model.pretrained), "checkpoint.export_hf": recipe.checkpoint.export_hf}
    wants = [key for key, on in asks.items() if on]
    if wants and not mapped:
        return [ConfigIssue(key, f"model.family {family!r} has no Hugging Face weight mapping") for key in wants]
    if not recipe.model.pretrained:
        return []
    try:
        pretrained = load_pretrained_config(recipe.model.pretrained)
    except ConfigError as exc:
        return list(exc.issues)
    return mismatch_issues(recipe.model, pretrained.model, pretrained.source)
