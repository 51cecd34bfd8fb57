"""Qwen3.5 / Qwen3.6 MoE (``qwen3_5_moe``) Hugging Face mapping: the published Qwen3.6-35B-A3B config.json reads
into the flagship recipe's model section; config and weights round-trip (Hub per-expert layout, ``mtp.*`` skipped);
checkpoints exchange with transformers' own ``Qwen3_5MoeForConditionalGeneration`` with equal logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_ac.config import load_recipe
from nemo_ac.config.hf import hf_config_dict, read_hf_config
from nemo_ac.config.schema import ModelConfig, MoEConfig
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.trainer.checkpoint.hf_safetensors import INDEX_FILE, export_hf_checkpoint, load_hf_checkpoint
from tests.factories import QWEN36_35B_A3B, qwen3_5_config

safetensors_torch = pytest.importorskip("safetensors.torch", reason="HF checkpoint IO needs safetensors")

ROOT = Path(__file__).resolve().parents[4]
FLAGSHIP = ROOT / "recipes" / "qwen3_6_35b_medpix_ep8cp2_4k.yaml"

# Qwen/Qwen3.6-35B-A3B config.json as published (transformers 4.57 era).


def tiny_config(*, vision_depth: int = 1) -> ModelConfig:
    return qwen3_5_config(
        vocab_size=80,
        hidden_size=32,
        head_dim=8,
        rope_theta=100000.0,
        mrope_section=[1, 1, 0],
        moe={"moe_intermediate_size": 12, "shared_expert_intermediate_size": 20},
        linear_attention={"value_head_dim": 4, "chunk_size": 16},
        vision={"depth": vision_depth},
    )


def _write(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_published_qwen36_config_is_the_flagship_recipe_model(tmp_path: Path) -> None:
    cfg = read_hf_config(_write(tmp_path, QWEN36_35B_A3B))
    recipe = load_recipe(FLAGSHIP).model
    # The recipe's architecture equals the published config; what differs are training knobs and our chunk size.
    for name in ("family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(recipe, name) == getattr(cfg, name), name
    for name in ("head_dim", "partial_rotary_factor", "rope_theta", "rms_norm_eps", "attn_output_gate", "qk_norm"):
        assert getattr(recipe, name) == getattr(cfg, name), name
    assert (recipe.layer_pattern or "LLLA" * 10) == cfg.layer_pattern == "LLLA" * 10
    assert recipe.mrope_section == cfg.mrope_section == [11, 11, 10]
    assert recipe.vision == cfg.vision
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        assert getattr(recipe.moe, name) == getattr(cfg.moe, name), name
    assert (recipe.moe.shared_expert_gate, recipe.moe.score_func, recipe.moe.norm_topk_prob) == (True, "softmax", True)
    for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
        assert getattr(recipe.linear_attention, name) == getattr(cfg.linear_attention, name), name
    # Built on meta (no memory): "35B total parameters" (the MTP head, skipped here, adds under 1B).
    total = sum(p.numel() for p in build_model(cfg).parameters())
    assert 34.0e9 < total < 36.0e9, total


def test_config_round_trip_and_transformers_reads_it_the_same_way(tmp_path: Path) -> None:
    cfg = tiny_config()
    assert read_hf_config(_write(tmp_path / "ours", hf_config_dict(cfg))) == cfg
    transformers = pytest.importorskip("transformers", reason="transformers is not importable")
    hf = transformers.Qwen3_5MoeConfig(**{k: v for k, v in hf_config_dict(cfg).items() if k != "model_type"})
    assert read_hf_config(_write(tmp_path / "hf", hf.to_dict())) == cfg
    with pytest.raises(ValueError, match=r"model.moe.score_func='sigmoid' \(needs 'softmax'\)"):
        hf_config_dict(ModelConfig(**{**vars(cfg), "moe": MoEConfig(score_func="sigmoid", shared_expert_gate=True)}))


def _hub_checkpoint(cfg: ModelConfig, root: Path) -> dict[str, torch.Tensor]:
    """Random bf16 weights under the Hub's names (per-expert matrices, an ``mtp.`` head), two files + index."""
    gen = torch.Generator().manual_seed(0)
    hub: dict[str, torch.Tensor] = {}
    for name, meta in build_model(cfg).state_dict().items():
        value = torch.randn(meta.shape, generator=gen).to(torch.bfloat16)
        prefix, _, local = name.rpartition(".")
        if prefix.endswith(".mlp.experts"):
            for e in range(value.shape[0]):
                if local == "gate_up_proj":
                    gate, up = value[e].chunk(2)
                    hub[f"{prefix}.{e}.gate_proj.weight"], hub[f"{prefix}.{e}.up_proj.weight"] = gate, up
                else:
                    hub[f"{prefix}.{e}.down_proj.weight"] = value[e]
        else:
            hub[name] = value
    hub = {k: v.clone().contiguous() for k, v in hub.items()}
    mtp = {"mtp.fc.weight": torch.zeros(4, 8, dtype=torch.bfloat16)}
    keys = sorted(hub)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    root.mkdir(parents=True, exist_ok=True)
    for i, (file, names) in enumerate(shards.items()):
        tensors = {k: hub[k] for k in names} | (mtp if i == 0 else {})
        safetensors_torch.save_file(tensors, str(root / file), metadata={"format": "pt"})
    weight_map = {k: file for file, names in shards.items() for k in names} | dict.fromkeys(mtp, next(iter(shards)))
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hub


def test_hub_layout_round_trip_is_byte_identical(tmp_path: Path) -> None:
    cfg = tiny_config()
    hub = _hub_checkpoint(cfg, tmp_path / "hub")
    assert (
        "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in hub and "model.visual.merger.norm.weight" in hub
    )
    model = build_model(cfg)
    model.to_empty(device="cpu")
    loaded = load_hf_checkpoint(model, tmp_path / "hub")  # mtp.* is skipped, everything else is a model tensor
    assert len(loaded) == len(model.state_dict())
    experts = model.model.language_model.layers[1].mlp.experts
    assert torch.equal(
        experts.down_proj[2], hub["model.language_model.layers.1.mlp.experts.2.down_proj.weight"].float()
    )
    export_hf_checkpoint(model, tmp_path / "out", dtype=torch.bfloat16, max_shard_bytes=30_000)
    out = {}
    for file in sorted((tmp_path / "out").glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(file)))
    assert sorted(out) == sorted(hub)
    for key, value in hub.items():
        assert torch.equal(out[key].view(torch.uint8), value.view(torch.uint8)), key
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3_5_moe"


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, position_ids=pos, attn=build_attention_inputs(torch.zeros_like(ids))).logits


def test_checkpoints_exchange_with_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not importable; HF parity needs it")
    pytest.importorskip("transformers.models.qwen3_5_moe", reason="this transformers has no qwen3_5_moe")
    cfg = tiny_config()
    ids = torch.randint(6, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))

    # nemo_ac -> Hub layout -> transformers.
    ours = materialize_and_init(build_model(cfg), device="cpu", seed=11).eval()
    export_hf_checkpoint(ours, tmp_path / "ours", max_shard_bytes=50_000)
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    hf = hf.eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(_logits(ours, ids), ref, atol=1e-4, rtol=1e-4)

    # transformers' own save_pretrained (sharded) -> nemo_ac.
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    loaded = build_model(read_hf_config(tmp_path / "hf"))
    loaded.to_empty(device="cpu")
    load_hf_checkpoint(loaded, tmp_path / "hf")
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(_logits(loaded.eval(), ids), ref, atol=1e-4, rtol=1e-4)
