"""Recipe keys of selective AC: defaults, overrides, and the errors bad values give before any process group."""

from __future__ import annotations

import pytest

from nemo_ac.config import ConfigError, load_recipe, validate_recipe
from tests.launch import RECIPES

TINY = str(RECIPES / "tiny" / "qwen3_moe_tiny.yaml")


def test_tiny_recipe_defaults_to_selective_with_workarounds():
    recipe = load_recipe(TINY, [])
    ac = recipe.activation_checkpointing
    assert (ac.mode, ac.workarounds, ac.placement) == ("selective", True, "inside")
    assert (ac.selective.save_every_other_mm, ac.selective.save_communication, ac.selective.save_router) == (
        True,
        True,
        True,
    )


def test_selective_overrides_load():
    recipe = load_recipe(
        TINY,
        ["activation_checkpointing.selective.save_router=false", "activation_checkpointing.workarounds=false"],
    )
    assert recipe.activation_checkpointing.selective.save_router is False
    assert recipe.activation_checkpointing.workarounds is False
    validate_recipe(recipe, world_size=2)


def test_misspelled_selective_key_names_the_key():
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.selective\.save_routr"):
        load_recipe(TINY, ["activation_checkpointing.selective.save_routr=false"])


def test_bad_mode_lists_the_choices():
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.mode"):
        load_recipe(TINY, ["activation_checkpointing.mode=sac"])


def test_offload_needs_full_or_no_checkpointing():
    """Selective AC keeps its saved op outputs in torch's SAC cache, out of reach of saved-tensor hooks."""
    recipe = load_recipe(TINY, ["activation_checkpointing.offload=true", "activation_checkpointing.mode=selective"])
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.offload: .*mode: full.*offload: false"):
        validate_recipe(recipe, world_size=2)
    full = load_recipe(
        TINY, ["activation_checkpointing.offload=true", "activation_checkpointing.mode=full", "compile.enabled=false"]
    )
    validate_recipe(full, world_size=2)
