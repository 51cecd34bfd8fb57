"""config.json <-> ModelConfig per family, and checkpoints exchanged with transformers itself (save_pretrained ->
nemo_ac, nemo_ac -> from_pretrained) giving the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_ac.config.hf import hf_config_dict, read_hf_config
from nemo_ac.config.schema import ModelConfig
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.trainer.checkpoint.hf_safetensors import export_hf_checkpoint, load_hf_checkpoint
from tests.factories import CONFIGS, GLM_45_AIR

pytest.importorskip("safetensors.torch", reason="HF checkpoint IO needs safetensors")


def _write(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_config_round_trip(family: str, tmp_path: Path) -> None:
    cfg = CONFIGS[family]()
    assert read_hf_config(_write(tmp_path, hf_config_dict(cfg))) == cfg


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_transformers_reads_our_config_the_same_way(family: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not importable")
    cfg = CONFIGS[family]()
    d = hf_config_dict(cfg)
    hf = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k != "model_type"}, model_type=family)
    assert read_hf_config(_write(tmp_path, hf.to_dict())) == cfg


def test_glm_45_air_config(tmp_path: Path) -> None:
    cfg = read_hf_config(_write(tmp_path, GLM_45_AIR))
    assert (cfg.family, cfg.num_layers, cfg.head_dim, cfg.partial_rotary_factor) == ("glm4_moe", 46, 128, 0.5)
    assert (cfg.rope_theta, cfg.attention_bias, cfg.qk_norm, cfg.first_k_dense_replace) == (1e6, True, False, 1)
    moe = cfg.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.shared_expert_intermediate_size) == (128, 8, 1408)
    assert (moe.score_func, moe.score_correction_bias, moe.router_dtype) == ("sigmoid", True, "float32")
    # Built on meta (no memory): GLM-4.5-Air is published as 106B total parameters (without its MTP layer here).
    total = sum(p.numel() for p in build_model(cfg).parameters())
    assert 1.05e11 < total < 1.08e11


def test_nemotron_legacy_keys_and_rejections(tmp_path: Path) -> None:
    legacy = {
        "model_type": "nemotron_h",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
        "layers_block_type": ["mamba", "moe", "attention", "mlp"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "ssm_state_size": 8,
        "mamba_n_groups": 2,
        "mamba_d_conv": 3,
        "mamba_chunk_size": 16,
        "mamba_dt_min": 0.002,
        "n_routed_experts": 4,
        "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": None,  # transformers falls back to intermediate_size
    }
    cfg = read_hf_config(_write(tmp_path / "a", legacy))
    assert (cfg.layer_pattern, cfg.num_layers, cfg.qk_norm) == ("ME*-", 4, False)
    assert (cfg.mamba.n_groups, cfg.mamba.conv_kernel, cfg.mamba.chunk_size, cfg.mamba.time_step_min) == (
        2,
        3,
        16,
        0.002,
    )
    assert cfg.moe.shared_expert_intermediate_size == 48 and cfg.moe.latent_size == 0
    build_model(cfg)
    with pytest.raises(NotImplementedError, match="mlp_hidden_act='silu'"):
        read_hf_config(_write(tmp_path / "b", {**legacy, "mlp_hidden_act": "silu"}))
    with pytest.raises(NotImplementedError, match="model_type 'llama' has no nemo_ac family"):
        read_hf_config(_write(tmp_path / "c", {"model_type": "llama"}))
    with pytest.raises(NotImplementedError, match="rope_type 'yarn'"):
        read_hf_config(_write(tmp_path / "d", {**GLM_45_AIR, "rope_scaling": {"type": "yarn", "factor": 4.0}}))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, position_ids=pos, attn=build_attention_inputs(torch.zeros_like(ids))).logits


@pytest.mark.parametrize("family", ["glm4_moe", "nemotron_h"])
def test_checkpoints_exchange_with_transformers(family: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not importable; HF parity needs it")
    cfg: ModelConfig = CONFIGS[family]()
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))

    # nemo_ac -> Hub layout -> transformers.
    ours = materialize_and_init(build_model(cfg), device="cpu", seed=11).eval()
    export_hf_checkpoint(ours, tmp_path / "ours", max_shard_bytes=50_000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(_logits(ours, ids), ref, atol=1e-4, rtol=1e-4)

    # transformers' own save_pretrained (Hub layout, sharded) -> nemo_ac.
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    loaded = build_model(read_hf_config(tmp_path / "hf"))
    loaded.to_empty(device="cpu")
    load_hf_checkpoint(loaded, tmp_path / "hf")
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(_logits(loaded.eval(), ids), ref, atol=1e-4, rtol=1e-4)
