"""Load a YAML recipe with omegaconf, merge ``key=value`` overrides, convert to the typed schema.

Conversion walks the dataclasses in ``schema`` key by key and collects every problem into one ``ConfigError``:
unknown keys (with the closest valid key), wrong types, values outside a ``Literal``. Before that, a
``model.pretrained`` fills every architecture key the recipe does not set from the checkpoint's config.json
(``config.pretrained``): the merged YAML + overrides are exactly the keys the user wrote, so schema defaults never
override config.json; each explicit key that does becomes one line in ``notes``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_ac.config.errors import ConfigError, ConfigIssue, did_you_mean
from nemo_ac.config.pretrained import fill_model_section
from nemo_ac.config.recipes import shipped_data_file
from nemo_ac.config.schema import RecipeConfig

_MISSING = object()


def load_recipe(
    path: str | Path, overrides: typing.Sequence[str] = (), *, notes: list[str] | None = None
) -> RecipeConfig:
    """Recipe file + dotlist overrides -> typed ``RecipeConfig`` (not yet cross-validated). ``notes`` (when given)
    collects what loading decided for the user to see: where ``model.pretrained``'s architecture came from and each
    recipe key that overrides its config.json."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(ConfigIssue("", f"recipe file '{path}' does not exist"))
    try:
        base = OmegaConf.load(path)
    except (OmegaConfBaseException, OSError, ValueError, yaml.YAMLError) as exc:  # YAMLError is no ValueError
        raise ConfigError(ConfigIssue("", f"cannot parse {path}: {exc}"), source=str(path)) from exc
    if not isinstance(base, DictConfig):
        raise ConfigError(ConfigIssue("", "a recipe must be a mapping of sections"), source=str(path))
    merged = merge_overrides(base, overrides, source=str(path))
    return recipe_from_container(merged, source=str(path), notes=notes)


def merge_overrides(base: DictConfig, overrides: typing.Sequence[str], *, source: str | None = None) -> DictConfig:
    bad = [item for item in overrides if "=" not in item]
    if bad:
        issues = [ConfigIssue(item, "override must look like 'section.key=value'") for item in bad]
        raise ConfigError(issues, source=source)
    # "=3" (or "+=3") would set the key "" and fail as "unknown key." with nothing before the colon.
    keyless = [item for item in overrides if not item.removeprefix("+").partition("=")[0].strip()]
    if keyless:
        issues = [ConfigIssue("", f"override {item!r} has no key; write section.key=value") for item in keyless]
        raise ConfigError(issues, source=source)
    # Hydra users write "+key=value" to add a key; every key can be set here, so the "+" is accepted and dropped.
    dotlist = [item[1:] if item.startswith("+") else item for item in overrides]
    try:
        return typing.cast(DictConfig, OmegaConf.merge(base, OmegaConf.from_dotlist(dotlist)))
    # Values are parsed as YAML ("key=[1" raises a YAMLError) and omegaconf's key parser raises plain Python errors
    # on malformed keys ("[=" -> IndexError): all of them are bad input, reported with the overrides.
    except (OmegaConfBaseException, yaml.YAMLError, LookupError, ValueError, TypeError) as exc:
        raise ConfigError(ConfigIssue("", f"cannot apply overrides {list(overrides)}: {exc}"), source=source) from exc


def recipe_from_container(
    data: DictConfig | dict[str, Any], *, source: str | None = None, notes: list[str] | None = None
) -> RecipeConfig:
    """The typed recipe of a mapping holding only the keys a user set (``model.pretrained`` fills the rest of
    ``model`` from its config.json, see ``load_recipe``)."""
    if isinstance(data, DictConfig):
        try:
            data = typing.cast(dict[str, Any], OmegaConf.to_container(data, resolve=True))
        except OmegaConfBaseException as exc:
            raise ConfigError(ConfigIssue("", f"cannot resolve interpolations: {exc}"), source=source) from exc
    if isinstance(data, dict) and isinstance(data.get("model"), dict) and data["model"].get("pretrained"):
        try:
            data = {**data, "model": fill_model_section(data["model"], notes)}
        except ConfigError as exc:
            raise ConfigError(exc.issues, source=source) from exc
    issues: list[ConfigIssue] = []
    recipe = _convert(RecipeConfig, data, "", issues)
    if issues:
        raise ConfigError(issues, source=source)
    return resolve_paths(typing.cast(RecipeConfig, recipe), notes=notes)


def resolve_paths(recipe: RecipeConfig, *, notes: list[str] | None = None) -> RecipeConfig:
    """Fill the paths whose default depends on another key (in place; returns ``recipe``): ``checkpoint.dir`` null
    or empty -> ``<logging.run_dir>/checkpoints``. An explicit ``checkpoint.dir`` is kept as written.

    A relative ``data.path`` under ``data/`` that is not there from the working directory but ships with nemo_ac
    (the tiny recipes' generated corpora) becomes the shipped file's absolute path, with a note: run from outside a
    checkout (a wheel install, ``nemo-ac train tiny/nemotron_super_v3_tiny``), the recipe otherwise fails with
    ``'data/tiny_corpus.jsonl' ... not found``. A file of that name in the working directory always wins."""
    if not recipe.checkpoint.dir:
        recipe.checkpoint.dir = str(Path(recipe.logging.run_dir) / "checkpoints")
    shipped = shipped_data_file(recipe.data.path) if recipe.data.path else None
    if shipped is not None and not Path(recipe.data.path).exists():
        if notes is not None:
            notes.append(
                f"data.path: {recipe.data.path} is not in the working directory; using nemo_ac's copy {shipped}"
            )
        recipe.data.path = str(shipped)
    return recipe


def to_dict(recipe: RecipeConfig) -> dict[str, Any]:
    """Plain-dict form (for logging the resolved recipe into the run directory)."""
    return dataclasses.asdict(recipe)


def to_yaml(recipe: RecipeConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(recipe)))


# --------------------------------------------------------------------------------------------------------------
# conversion


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _describe(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    if _is_optional(tp):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return " or ".join(_describe(a) for a in inner) + " or null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp)


def _convert(tp: Any, value: Any, key: str, issues: list[ConfigIssue]) -> Any:
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(typing.cast(type, tp), value, key, issues)
    if _is_optional(tp):
        if value is None:
            return None
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return _convert(inner, value, key, issues)
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        hint = did_you_mean(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
        issues.append(ConfigIssue(key, f"{value!r} is not valid; choose one of {list(choices)}.{hint}"))
        return _MISSING
    if origin is list:
        if not isinstance(value, list | ListConfig):
            issues.append(ConfigIssue(key, f"expected a list, got {value!r}"))
            return _MISSING
        (item_tp,) = get_args(tp)
        return [_convert(item_tp, item, f"{key}[{i}]", issues) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            issues.append(ConfigIssue(key, f"expected a mapping, got {value!r}"))
            return _MISSING
        _, value_tp = get_args(tp) or (str, Any)
        converted = {name: _convert(value_tp, item, _join(key, str(name)), issues) for name, item in value.items()}
        return {name: item for name, item in converted.items() if item is not _MISSING}
    if tp is Any:
        return value
    return _convert_scalar(tp, value, key, issues)


def _convert_scalar(tp: Any, value: Any, key: str, issues: list[ConfigIssue]) -> Any:
    ok = False
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif tp is str:
        ok = isinstance(value, str)
    if not ok:
        issues.append(ConfigIssue(key, f"expected {_describe(tp)}, got {value!r} ({type(value).__name__})"))
        return _MISSING
    return value


def _convert_dataclass(cls: type, value: Any, key: str, issues: list[ConfigIssue]) -> Any:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        issues.append(ConfigIssue(key or "<root>", f"expected a mapping (section), got {value!r}"))
        return cls()
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for name in value:
        if name not in known:
            where = f"'{key}'" if key else "the recipe root"
            issues.append(
                ConfigIssue(
                    _join(key, str(name)),
                    f"unknown key.{did_you_mean(str(name), known, prefix=key)} Valid keys in {where}: {', '.join(known)}",
                )
            )
    kwargs: dict[str, Any] = {}
    for name in known:
        if name in value:
            converted = _convert(hints[name], value[name], _join(key, name), issues)
            if converted is not _MISSING:
                kwargs[name] = converted
    return cls(**kwargs)
