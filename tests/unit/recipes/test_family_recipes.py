"""The GLM-4.5-Air and Nemotron 3 Super recipes: the full ones validate at their world sizes without TE / DeepEP
installed, ``--check-env`` names what is missing (key and how to install it), their architecture adds up to the published
model sizes, and the tiny ones keep the full ones' structure. The Transformer Engine adapter fails clearly without
TE and is never imported when no backend asks for it."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from nemo_ac.cli import main as cli
from nemo_ac.config import ConfigError, load_recipe, validate_recipe
from nemo_ac.models import build_model
from nemo_ac.models.te_backend import apply_te_backends
from tests.launch import RECIPES

FULL = {"nemotron_super_v3_te_deepep.yaml": 64, "glm_4_5_air_cp4_ulysses.yaml": 8}
TINY = {
    "nemotron_super_v3_te_deepep.yaml": "nemotron_super_v3_tiny.yaml",
    "glm_4_5_air_cp4_ulysses.yaml": "glm_4_5_air_tiny.yaml",
}
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
HAS_DEEPEP = importlib.util.find_spec("deep_ep") is not None


@pytest.mark.parametrize("name", sorted(FULL))
def test_full_recipe_validates_at_its_world_size(name: str, capsys) -> None:
    assert cli(["validate", str(RECIPES / name), "--world-size", str(FULL[name])]) == 0
    assert f"OK at world size {FULL[name]}" in capsys.readouterr().out
    with pytest.raises(ConfigError):  # and only there: half the ranks cannot hold the layout
        validate_recipe(load_recipe(RECIPES / name), world_size=FULL[name] // 2 - 1)


@pytest.mark.skipif(HAS_TE or HAS_DEEPEP, reason="te / deep_ep are installed here: nothing is missing")
def test_check_env_names_the_key_and_the_install(capsys) -> None:
    assert (
        cli(["validate", str(RECIPES / "nemotron_super_v3_te_deepep.yaml"), "--world-size", "64", "--check-env"]) == 2
    )
    err = capsys.readouterr().err
    assert "backend.dispatcher: 'deepep' needs DeepEP (the 'deep_ep' module), which is not installed" in err
    assert "parallel.ep=64 spans nodes: DeepEP's internode kernels need it built with NVSHMEM" in err
    assert "git clone https://github.com/deepseek-ai/DeepEP" in err and "python setup.py install" in err
    assert "backend.dispatcher: 'deepep' runs DeepEP's CUDA kernels and no GPU is visible" in err
    for key in ("backend.linear", "backend.rms_norm"):
        assert f"{key}: 'te' needs the optional package 'transformer_engine'" in err
    assert "pip install 'nemo_ac[te]'" in err


def _counts(name: str) -> tuple[float, float]:
    """(total, active per token) parameters of the recipe's model, built on the meta device."""
    recipe = load_recipe(RECIPES / name)
    model = build_model(recipe.model)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    moe = recipe.model.moe
    return total, total - experts * (1 - moe.num_experts_per_tok / moe.num_experts)


def test_full_architectures_add_up_to_the_published_sizes() -> None:
    """Nemotron 3 Super: 120B total / 12B active (12.7B with embeddings); GLM-4.5-Air: 106B total / 12B active
    (+1.2B of embedding and output tables). A wrong width, expert count or layer pattern would miss these."""
    total, active = _counts("nemotron_super_v3_te_deepep.yaml")
    assert 119.5e9 < total < 121.5e9 and 12.0e9 < active < 13.0e9, (total, active)
    total, active = _counts("glm_4_5_air_cp4_ulysses.yaml")
    assert 106.0e9 < total < 107.5e9 and 12.0e9 < active < 13.6e9, (total, active)


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_recipe_keeps_the_structure(name: str) -> None:
    full, tiny = load_recipe(RECIPES / name), load_recipe(RECIPES / "tiny" / TINY[name])
    # Differences on purpose, each named in the tiny recipe's header: Nemotron's full recipe runs full AC (selective
    # needs ~137 GiB per rank at its size), the tiny one keeps selective (the layout the SAC tests exercise).
    on_purpose = {("nemotron_super_v3_te_deepep.yaml", "activation_checkpointing.mode")}
    validate_recipe(tiny, world_size=2)
    for section, keys in {
        "model": ("family", "qk_norm", "attention_bias", "first_k_dense_replace", "partial_rotary_factor"),
        "model.moe": ("score_func", "score_correction_bias", "activation", "router_dtype", "norm_topk_prob"),
        "parallel": ("cp_type",),
        "activation_checkpointing": ("mode", "offload"),
    }.items():
        f, t = full, tiny
        for part in section.split("."):
            f, t = getattr(f, part), getattr(t, part)
        for key in keys:
            if (name, f"{section}.{key}") not in on_purpose:
                assert getattr(t, key) == getattr(f, key), f"{section}.{key}"
    assert (tiny.parallel.cp > 1) == (full.parallel.cp > 1) and (tiny.parallel.ep > 1) == (full.parallel.ep > 1)
    assert bool(tiny.model.moe.latent_size) == bool(full.model.moe.latent_size)
    assert set(tiny.model.layer_pattern) == set(full.model.layer_pattern)
    assert tiny.model.moe.bias_update_rate > 0 and full.model.moe.bias_update_rate > 0


def test_te_adapter_is_lazy_and_fails_clearly() -> None:
    recipe = load_recipe(RECIPES / "tiny" / "nemotron_super_v3_tiny.yaml")
    layers = build_model(recipe.model).model.layers
    defaults = {"linear": "torch", "rms_norm": "torch", "attention": "sdpa"}
    assert apply_te_backends(layers, **defaults) == {"linear": 0, "rms_norm": 0, "attention": 0}
    if HAS_TE:
        pytest.skip("transformer_engine is installed: the absent-package error cannot be observed")
    assert "transformer_engine" not in sys.modules
    for key in ("linear", "rms_norm", "attention"):
        with pytest.raises(ConfigError) as info:
            apply_te_backends(layers, **{**defaults, key: "te"})
        assert info.value.keys == [f"backend.{key}"]
        assert "pip install 'nemo_ac[te]'" in str(info.value)
