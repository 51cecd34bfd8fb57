"""Recipes: typed schema, omegaconf loading with overrides, and validation before any process group starts."""

from nemo_ac.config.environment import check_environment
from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.layout import ParallelLayout
from nemo_ac.config.load import load_recipe, recipe_from_container, to_dict, to_yaml
from nemo_ac.config.schema import RecipeConfig
from nemo_ac.config.validate import validate_recipe

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "ParallelLayout",
    "RecipeConfig",
    "check_environment",
    "load_recipe",
    "recipe_from_container",
    "to_dict",
    "to_yaml",
    "validate_recipe",
]
