"""A model family declares its recipe rules once (``FamilyRules`` in its ``config/hf`` module) and every rule asks
that declaration: no rule switches on a family name, so a family is added by its own modules plus one line in
each of the three registration tables (the schema's ``Family``, ``config/hf``'s imports, ``models``' builders)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from nemo_ac.config import ConfigError, RecipeConfig, validate_recipe
from nemo_ac.config.families import FamilyRules, HeadGroup, RecurrentMixer
from nemo_ac.config.hf import FAMILY_RULES, family_rules
from nemo_ac.config.schema import Family
from tests.factories import PACKAGE_DIR

# Where a family's name may be written: its own modules and the registration tables.
REGISTRATION_FILES = {"config/schema.py", "models/__init__.py"}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    owners = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, owners)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _family_name_uses(families: set[str]) -> list[str]:
    """Each string literal (docstrings aside) equal to a family name, outside the family's own modules."""
    hits = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        own = relative.startswith("config/hf/") or Path(relative).stem in families
        if own or relative in REGISTRATION_FILES:
            continue
        tree = ast.parse(path.read_text())
        docstrings = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in families and id(node) not in docstrings:
                hits.append(f"{relative}:{node.lineno}: {node.value!r}")
    return hits


def test_every_family_of_the_schema_declares_its_rules():
    assert set(FAMILY_RULES) == set(Family.__args__)


def test_no_rule_switches_on_a_family_name():
    hits = _family_name_uses(set(FAMILY_RULES))
    assert not hits, f"family names outside the families' own modules (declare it in FamilyRules instead): {hits}"


def test_the_scan_finds_a_family_name_where_it_is_written(tmp_path, monkeypatch):
    """The scan is not blind: a rule that tests ``m.family == "nemotron_h"`` in a package module is found."""
    package = tmp_path / "nemo_ac"
    (package / "config").mkdir(parents=True)
    (package / "config" / "rules.py").write_text('def check(m):\n    return m.family == "nemotron_h"\n')
    monkeypatch.setattr(f"{__name__}.PACKAGE_DIR", package)
    assert _family_name_uses(set(FAMILY_RULES)) == ["config/rules.py:2: 'nemotron_h'"]


def _qwen3_recipe(**model: object) -> RecipeConfig:
    recipe = RecipeConfig()
    recipe.model = dataclasses.replace(recipe.model, family="qwen3_moe", **model)
    recipe.parallel = dataclasses.replace(recipe.parallel, cp=2, cp_type="ulysses")
    recipe.train = dataclasses.replace(recipe.train, global_batch_size=8, micro_batch_size=1)
    return recipe


def test_the_rules_read_the_declaration_not_the_family_name(monkeypatch):
    """Declare a recurrent mixer, a layer pattern and a vision tower for qwen3_moe, and the context-parallel, layer
    pattern and freeze rules judge it by them: nothing else was edited."""
    recipe = _qwen3_recipe(layer_pattern="XY")
    with pytest.raises(ConfigError, match="family 'qwen3_moe' takes no layer_pattern"):
        validate_recipe(recipe, world_size=2)  # as qwen3_moe declares itself: no layer pattern, no recurrent mixer
    declared = FamilyRules(
        "qwen3_moe",
        layer_pattern_chars="X",
        recurrent_mixers=lambda cfg: (RecurrentMixer("Toy", "mamba", 4, (HeadGroup("num_layers", 3),)),),
    )
    monkeypatch.setitem(FAMILY_RULES, "qwen3_moe", declared)
    assert family_rules("qwen3_moe") is declared
    with pytest.raises(ConfigError) as raised:
        validate_recipe(recipe, world_size=2)
    message = str(raised.value)
    assert re.search(r"'XY' has characters \['Y'\]; family qwen3_moe allows \['X'\]", message)
    assert "ulysses CP splits Toy heads: model.num_layers=3 must be divisible by cp=2" in message
