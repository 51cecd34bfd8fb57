"""The flagship recipes say ``model.pretrained`` instead of retyping the architecture: offline (HF_HUB_OFFLINE, no
cache) they resolve from the shipped config.json snapshots to exactly the architecture they used to spell out, the
snapshots are the published configs the HF tests read, and each recipe key that overrides config.json is noted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nemo_ac.config import load_recipe
from nemo_ac.config.pretrained import flatten, snapshot_path
from tests.factories import GLM_45_AIR, QWEN36_35B_A3B
from tests.launch import RECIPES

RETYPED = json.loads((Path(__file__).parent / "data" / "flagship_models_retyped.json").read_text())
FLAGSHIPS = {
    "glm_4_5_air_cp4_ulysses": "zai-org/GLM-4.5-Air",
    "nemotron_super_v3_te_deepep": "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
    "qwen3_6_35b_medpix_ep8cp2_4k": "Qwen/Qwen3.6-35B-A3B",
}


@pytest.mark.parametrize("name", sorted(FLAGSHIPS))
def test_flagship_resolves_to_its_old_retyped_architecture(name: str) -> None:
    notes: list[str] = []
    recipe = load_recipe(RECIPES / f"{name}.yaml", notes=notes)
    assert recipe.model.pretrained == FLAGSHIPS[name]
    resolved, retyped = flatten(dataclasses.asdict(recipe.model)), flatten(RETYPED[name])
    assert {k: v for k, v in resolved.items() if retyped.get(k) != v} == {}
    assert resolved == retyped
    assert notes[0].startswith(f"model.pretrained: architecture from recipes/hf_configs/{FLAGSHIPS[name]}/config.json")


@pytest.mark.parametrize("name", sorted(FLAGSHIPS))
def test_flagship_recipe_no_longer_retypes_the_architecture(name: str) -> None:
    text = (RECIPES / f"{name}.yaml").read_text()
    for key in ("vocab_size:", "hidden_size:", "num_layers:", "num_attention_heads:", "num_experts:", "head_dim:"):
        assert key not in text, key
    assert len(text.splitlines()) < 70


def test_snapshots_are_the_published_configs() -> None:
    assert json.loads(snapshot_path("zai-org/GLM-4.5-Air").read_text()) == GLM_45_AIR
    assert json.loads(snapshot_path("Qwen/Qwen3.6-35B-A3B").read_text()) == QWEN36_35B_A3B


def test_overrides_are_noted_and_only_explicit_keys_override() -> None:
    notes: list[str] = []
    recipe = load_recipe(
        RECIPES / "qwen3_6_35b_medpix_ep8cp2_4k.yaml", ["model.max_position_embeddings=4096"], notes=notes
    )
    assert recipe.model.max_position_embeddings == 4096 and recipe.model.num_layers == 40
    assert "model.max_position_embeddings: recipe 4096 overrides config.json 262144" in notes
    assert "model.moe.router_dtype: recipe 'float32' overrides config.json 'param'" in notes
    assert notes[0].endswith("2 key(s) overridden by the recipe")
    # A key the recipe does not write keeps config.json's value even where the schema default differs.
    assert recipe.model.vocab_size == 248320 and recipe.model.rms_norm_eps == 1e-6


def test_the_calibration_recipe_is_qwen3_30b_a3b_from_its_snapshot() -> None:
    """benchmarks/recipes/qwen3_30b_a3b_automodel_ep8.yaml (the estimate's calibration row) validates offline at 8
    ranks from the shipped Qwen3-30B-A3B config.json: 48 layers of 128 experts, top-8, EP8 x FSDP8."""
    from nemo_ac.config import validate_recipe

    notes: list[str] = []
    path = RECIPES.parent / "benchmarks" / "recipes" / "qwen3_30b_a3b_automodel_ep8.yaml"
    recipe = load_recipe(path, notes=notes)
    assert notes[0].startswith("model.pretrained: architecture from recipes/hf_configs/Qwen/Qwen3-30B-A3B/config.json")
    model = recipe.model
    assert (model.num_layers, model.hidden_size, model.moe.num_experts, model.moe.num_experts_per_tok) == (
        48,
        2048,
        128,
        8,
    )
    layout = validate_recipe(recipe, world_size=8)
    assert (layout.ep, layout.dp_shard) == (8, 8)
    assert (recipe.train.global_batch_size, recipe.train.micro_batch_size, recipe.data.seq_len) == (512, 4, 4096)
