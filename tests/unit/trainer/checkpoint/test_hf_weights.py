"""model.pretrained / checkpoint.export_hf in the trainer (trainer/checkpoint/hf_weights.py): a local config.json that
disagrees with the recipe is a ConfigError naming each key (before any process group), fields that change neither
weights nor math may differ, loading replaces random init, and an export replaces the previous one atomically."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from nemo_ac.config import ConfigError, load_recipe
from nemo_ac.config.hf import hf_config_dict
from nemo_ac.config.schema import CheckpointConfig
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.trainer.checkpoint.export_target import EXPORT_MARKER, is_export_dir
from nemo_ac.trainer.checkpoint.hf_weights import (
    architecture_issues,
    architecture_mismatches,
    check_hf_weights,
    export_final_hf,
    materialize_weights,
)
from tests.factories import read_dir, write_hub_checkpoint
from tests.launch import RECIPES

safetensors_torch = pytest.importorskip("safetensors.torch", reason="HF checkpoint IO needs safetensors")

NEMOTRON = RECIPES / "tiny" / "nemotron_super_v3_tiny.yaml"


def _hf_dir(tmp_path: Path, model_cfg, **changes) -> Path:
    """A local HF model directory: random weights in the Hub layout and a config.json for ``model_cfg``."""
    root = tmp_path / "hf"
    write_hub_checkpoint(model_cfg, root, dtype=torch.float32)
    config = hf_config_dict(model_cfg)
    config.update(changes)
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_matching_directory_passes_and_each_mismatch_is_named(tmp_path: Path) -> None:
    recipe = load_recipe(NEMOTRON)
    root = _hf_dir(tmp_path, recipe.model, hidden_size=96, mamba_num_heads=8, chunk_size=64, max_position_embeddings=9)
    recipe.model.pretrained = str(root)
    issues = {issue.key: issue.message for issue in check_hf_weights(recipe)}
    assert set(issues) == {"model.hidden_size", "model.mamba.num_heads"}  # chunk_size / max positions may differ
    assert "recipe says 64 but" in issues["model.hidden_size"] and "config.json says 96" in issues["model.hidden_size"]
    assert "set model.mamba.num_heads: 8" in issues["model.mamba.num_heads"]
    (root / "config.json").write_text(json.dumps(hf_config_dict(recipe.model)))
    assert check_hf_weights(recipe) == []


def test_training_knobs_are_not_architecture(tmp_path: Path) -> None:
    recipe = load_recipe(NEMOTRON)
    changed = dataclasses.replace(
        recipe.model,
        init_std=0.5,
        moe=dataclasses.replace(recipe.model.moe, router_dtype="param", aux_loss_coef=0.1, bias_update_rate=0.0),
    )
    assert architecture_mismatches(recipe.model, changed) == []
    assert architecture_mismatches(recipe.model, dataclasses.replace(recipe.model, qk_norm=True)) == [
        ("qk_norm", False, True)
    ]


def test_directory_problems_and_families_without_a_mapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # model.pretrained fills the architecture when the recipe is loaded, so a config.json that cannot be found or
    # read fails right there, naming the key (no process group, no torch needed).
    def load_error(value: str) -> str:
        with pytest.raises(ConfigError) as info:
            load_recipe(NEMOTRON, [f"model.pretrained={value}"])
        assert info.value.keys == ["model.pretrained"]
        return str(info.value)

    assert "is a directory without config.json" in load_error(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "model_type 'llama' has no nemo_ac family" in load_error(str(tmp_path))
    recipe = load_recipe(NEMOTRON)
    (issue,) = architecture_issues(recipe.model, tmp_path)  # the post-download check reads it the same way
    assert issue.key == "model.pretrained" and "llama" in issue.message
    assert "is not available here" in load_error("nvidia/some-model")  # HF_HUB_OFFLINE (conftest): no download
    assert "is not a directory (nor a Hub id" in load_error(str(tmp_path / "no" / "such"))
    glm = load_recipe(RECIPES / "tiny" / "glm_4_5_air_tiny.yaml", ["checkpoint.export_hf=true"])
    assert check_hf_weights(glm) == []  # every shipped family has a mapping ...
    import nemo_ac.config.hf.registry as registry  # ... so take one away to see the rejection

    monkeypatch.setattr(registry, "HF_FAMILIES", {k: v for k, v in registry.HF_FAMILIES.items() if k != "glm4_moe"})
    monkeypatch.setattr("nemo_ac.config.pretrained.HF_FAMILIES", registry.HF_FAMILIES)
    (issue,) = check_hf_weights(glm)
    assert issue.key == "checkpoint.export_hf" and "no Hugging Face weight mapping" in issue.message


def test_materialize_weights_loads_or_initializes(tmp_path: Path) -> None:
    recipe = load_recipe(NEMOTRON)
    hub = {
        k.replace("backbone.", "model.", 1): v
        for k, v in write_hub_checkpoint(recipe.model, tmp_path / "w", dtype=torch.float32).items()
    }
    (tmp_path / "w" / "config.json").write_text(json.dumps(hf_config_dict(recipe.model)))
    random = build_model(recipe.model)
    assert materialize_weights(random, model_config=recipe.model, device=torch.device("cpu"), seed=1) == "random init"
    torch.testing.assert_close(
        random.state_dict()["lm_head.weight"],
        materialize_and_init(build_model(recipe.model), device="cpu", seed=1).state_dict()["lm_head.weight"],
    )
    loaded_cfg = dataclasses.replace(recipe.model, pretrained=str(tmp_path / "w"))
    loaded = build_model(loaded_cfg)
    what = materialize_weights(loaded, model_config=loaded_cfg, device=torch.device("cpu"), seed=1)
    assert what.startswith("weights from")
    torch.testing.assert_close(loaded.state_dict()["lm_head.weight"], hub["lm_head.weight"], rtol=0, atol=0)
    mismatched = dataclasses.replace(loaded_cfg, vocab_size=128)
    with pytest.raises(ConfigError, match=r"model.vocab_size: recipe says 128"):
        materialize_weights(build_model(mismatched), model_config=mismatched, device=torch.device("cpu"), seed=1)


def test_export_replaces_the_previous_export_whole(tmp_path: Path) -> None:
    recipe = load_recipe(NEMOTRON)
    model = materialize_and_init(build_model(recipe.model), device="cpu", seed=2)
    config = CheckpointConfig(dir=str(tmp_path / "ckpt"), export_hf=True)
    out = tmp_path / "ckpt" / "hf"
    out.mkdir(parents=True)
    (out / "model-00001-of-00009.safetensors").write_text("a shard of an older, larger export")
    assert export_final_hf(model, config=config) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", EXPORT_MARKER]
    assert is_export_dir(out)  # a later export (or nemo-ac export without --force) may replace it
    assert not any(p.name.startswith(".") for p in (tmp_path / "ckpt").iterdir())
    exported = read_dir(out)
    assert exported["backbone.embeddings.weight"].dtype == torch.float32
    bf16 = dataclasses.replace(config, export_hf_dir=str(tmp_path / "bf16"), export_dtype="bfloat16")
    assert read_dir(export_final_hf(model, config=bf16))["backbone.embeddings.weight"].dtype == torch.bfloat16
