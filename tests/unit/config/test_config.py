"""Recipe loading and validation: every bad input names its key, the bad value and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_ac.config import ConfigError, load_recipe, validate_recipe
from nemo_ac.config.environment import check_environment

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"


def load(*overrides: str):
    return load_recipe(TINY, list(overrides))


def test_tiny_recipe_loads_and_overrides_apply():
    recipe = load("model.num_layers=4", "train.steps=10", "train.lr=1e-3")
    assert recipe.model.num_layers == 4
    assert recipe.train.steps == 10
    assert recipe.train.lr == pytest.approx(1e-3)
    layout = validate_recipe(recipe, world_size=2)
    assert (layout.dp_replicate, layout.dp_shard, layout.cp, layout.ep) == (1, 2, 1, 1)


def test_typo_key_suggests_closest():
    with pytest.raises(ConfigError) as info:
        load("model.num_layer=4")
    message = str(info.value)
    assert "model.num_layer: unknown key" in message
    assert "Did you mean 'model.num_layers'?" in message
    assert info.value.keys == ["model.num_layer"]


def test_typo_section_suggests_closest():
    with pytest.raises(ConfigError, match=r"trian: unknown key\. Did you mean 'train'\?"):
        load("trian.steps=3")


def test_wrong_type_names_key_value_and_expected_type():
    with pytest.raises(ConfigError) as info:
        load("train.steps=ten")
    assert "train.steps: expected an integer, got 'ten' (str)" in str(info.value)


def test_bool_is_not_an_int():
    with pytest.raises(ConfigError, match=r"model.num_layers: expected an integer, got True"):
        load("model.num_layers=true")


def test_unknown_ac_mode_lists_choices():
    with pytest.raises(ConfigError) as info:
        load("activation_checkpointing.mode=selectve")
    message = str(info.value)
    assert "activation_checkpointing.mode: 'selectve' is not valid" in message
    assert "['none', 'full', 'selective']" in message
    assert "Did you mean 'selective'?" in message


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load("model.num_layer=4", "train.steps=x", "compile.layout=inner")
    assert sorted(info.value.keys) == ["compile.layout", "model.num_layer", "train.steps"]


def test_world_size_that_does_not_divide():
    recipe = load("parallel.cp=2")
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe, world_size=3)
    message = str(info.value)
    assert "parallel.dp_shard: world size 3 is not divisible by dp_replicate*cp = 1*2" in message


def test_explicit_degrees_must_multiply_to_world_size():
    recipe = load("parallel.dp_shard=2", "parallel.cp=2")
    with pytest.raises(ConfigError, match=r"dp_replicate\*dp_shard\*cp = 1\*2\*2 = 4 must equal the world size 2"):
        validate_recipe(recipe, world_size=2)


def test_batch_not_divisible_by_dp_times_micro():
    recipe = load("train.global_batch_size=6", "train.micro_batch_size=2")
    with pytest.raises(
        ConfigError, match=r"train.global_batch_size: 6 must be divisible by dp\*micro_batch_size = 2\*2"
    ):
        validate_recipe(recipe, world_size=2)


def test_ep_must_divide_and_experts_must_split():
    recipe = load("parallel.ep=3", "model.moe.num_experts=4")
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe, world_size=2)
    message = str(info.value)
    assert "parallel.ep: ep=3 must divide dp_shard*cp = 2*1 = 2" in message
    assert "model.moe.num_experts: 4 experts cannot be split over parallel.ep=3" in message


def test_override_without_equals():
    with pytest.raises(ConfigError, match=r"train.steps: override must look like 'section.key=value'"):
        load("train.steps")


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_optimizer_target_allowlist():
    recipe = load("+train.optimizer._target_=os.system")
    with pytest.raises(ConfigError, match=r"train.optimizer._target_: 'os.system' is outside the allowed"):
        validate_recipe(recipe, world_size=1)


def test_absent_optional_extra_is_a_clear_error():
    recipe = load("backend.dispatcher=deepep")
    issues = check_environment(recipe, cuda_available=False)
    text = " ".join(str(issue) for issue in issues)
    assert "backend.dispatcher: 'deepep' needs DeepEP (the 'deep_ep' module), which is not installed" in text
    assert "git clone https://github.com/deepseek-ai/DeepEP" in text and "python setup.py install" in text
    assert "backend.dispatcher: 'deepep' runs DeepEP's CUDA kernels and no GPU is visible" in text
