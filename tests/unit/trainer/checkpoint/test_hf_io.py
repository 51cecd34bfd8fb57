"""HF safetensors checkpoints: Hub (per-expert) layout -> nemo_ac grouped experts -> Hub layout, byte for byte;
plain, activation-checkpoint-wrapped and FSDP2 (DTensor) models; clear errors naming key and file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.trainer.checkpoint.hf_safetensors import (
    INDEX_FILE,
    HFCheckpointError,
    export_hf_checkpoint,
    load_hf_checkpoint,
    materialize_and_load,
    resolve_pretrained,
)
from tests.factories import CONFIGS, assert_bytes_equal, glm_config, nemotron_config, read_dir, write_hub_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch", reason="HF checkpoint IO needs safetensors")


def _materialized(cfg: ModelConfig) -> torch.nn.Module:
    model = build_model(cfg)
    model.to_empty(device="cpu")
    return model


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_hub_layout_round_trip_is_byte_identical(family: str, tmp_path: Path) -> None:
    cfg = CONFIGS[family]()
    hub = write_hub_checkpoint(cfg, tmp_path / "hub")
    model = _materialized(cfg)  # fp32 parameters: bf16 -> fp32 -> bf16 is exact
    loaded = load_hf_checkpoint(model, tmp_path / "hub")
    assert len(loaded) == len(model.state_dict()) - int(cfg.tie_word_embeddings)

    # Grouped experts hold the per-expert matrices at the right place (gate rows before up rows).
    moe_idx = next(i for i, layer in enumerate(model.model.layers) if layer.is_moe)
    experts = model.model.layers[moe_idx].routed_moe().experts_module()
    prefix = ("backbone" if family == "nemotron_h" else "model") + f".layers.{moe_idx}"
    prefix += ".mixer.experts" if family == "nemotron_h" else ".mlp.experts"
    first = "up_proj" if family == "nemotron_h" else "gate_proj"
    rows = hub[f"{prefix}.1.{first}.weight"].shape[0]
    assert torch.equal(experts.in_proj[1, :rows], hub[f"{prefix}.1.{first}.weight"].float())
    assert torch.equal(experts.down_proj[2], hub[f"{prefix}.2.down_proj.weight"].float())

    files = export_hf_checkpoint(model, tmp_path / "out", dtype=torch.bfloat16, max_shard_bytes=20_000)
    assert len(files) > 1 and (tmp_path / "out" / INDEX_FILE).is_file()
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(hub)
    assert_bytes_equal(read_dir(tmp_path / "out"), hub)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family


def test_grouped_transformers5_names_load_too(tmp_path: Path) -> None:
    cfg = glm_config()
    write_hub_checkpoint(cfg, tmp_path / "per_expert")
    write_hub_checkpoint(cfg, tmp_path / "grouped", grouped=True)  # same seed, same values
    a = materialize_and_load(build_model(cfg), tmp_path / "per_expert", device="cpu")
    b = materialize_and_load(build_model(cfg), tmp_path / "grouped", device="cpu")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_checkpoint_wrapped_model_and_ignored_mtp_keys(tmp_path: Path) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    cfg = nemotron_config()
    hub = write_hub_checkpoint(cfg, tmp_path)
    safetensors_torch.save_file({"mtp.layers.0.norm.weight": torch.ones(4)}, str(tmp_path / "mtp.safetensors"))
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["mtp.layers.0.norm.weight"] = "mtp.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    model = build_model(cfg)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    model.to_empty(device="cpu")
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    load_hf_checkpoint(model, tmp_path)
    export_hf_checkpoint(model, tmp_path / "out", dtype=torch.bfloat16)
    assert_bytes_equal(read_dir(tmp_path / "out"), hub)


def _edit(root: Path, file: str, edit: dict[str, torch.Tensor | None]) -> None:
    tensors = safetensors_torch.load_file(str(root / file))
    index = json.loads((root / INDEX_FILE).read_text())
    for key, value in edit.items():
        if value is None:
            tensors.pop(key)
            index["weight_map"].pop(key)
        else:
            tensors[key] = value
            index["weight_map"][key] = file
    safetensors_torch.save_file(tensors, str(root / file), metadata={"format": "pt"})
    (root / INDEX_FILE).write_text(json.dumps(index))


def test_errors_name_the_key_and_the_file(tmp_path: Path) -> None:
    cfg = glm_config()
    write_hub_checkpoint(cfg, tmp_path)
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    q_file, e_file = (
        weight_map["model.layers.1.self_attn.q_proj.weight"],
        weight_map["model.layers.2.mlp.experts.3.up_proj.weight"],
    )
    _edit(tmp_path, q_file, {"model.layers.1.self_attn.q_proj.weight": torch.zeros(3, 3)})
    _edit(tmp_path, e_file, {"model.layers.2.mlp.experts.3.up_proj.weight": None})
    _edit(tmp_path, q_file, {"model.layers.0.mlp.bogus.weight": torch.zeros(2)})
    model = materialize_and_init(build_model(cfg), device="cpu", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HFCheckpointError) as err:
        load_hf_checkpoint(model, tmp_path)
    msg = str(err.value)
    assert f"shape of 'model.layers.1.self_attn.q_proj.weight' in {q_file} is [3, 3], model expects [48, 48]" in msg
    assert "missing per-expert keys for 'model.layers.2.mlp.experts.gate_up_proj'" in msg
    assert "'model.layers.2.mlp.experts.3.up_proj.weight'" in msg
    assert f"unexpected key 'model.layers.0.mlp.bogus.weight' in {q_file}" in msg
    # Validation happens before any copy: a failed load leaves the model untouched.
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_glm_mtp_layer_is_skipped(tmp_path: Path) -> None:
    """GLM-4.5 checkpoints carry their multi-token-prediction layer as model.layers.<num_layers>.*."""
    cfg = glm_config()
    write_hub_checkpoint(cfg, tmp_path)
    file = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]["model.norm.weight"]
    _edit(tmp_path, file, {f"model.layers.{cfg.num_layers}.eh_proj.weight": torch.zeros(2, 2)})
    load_hf_checkpoint(_materialized(cfg), tmp_path)
    _edit(tmp_path, file, {f"model.layers.{cfg.num_layers - 1}.eh_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(HFCheckpointError, match="unexpected key"):
        load_hf_checkpoint(_materialized(cfg), tmp_path)


def test_missing_key_and_meta_model(tmp_path: Path) -> None:
    cfg = CONFIGS["qwen3_moe"]()
    write_hub_checkpoint(cfg, tmp_path)
    with pytest.raises(RuntimeError, match="materialize the model"):
        load_hf_checkpoint(build_model(cfg), tmp_path)
    file = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]["model.norm.weight"]
    _edit(tmp_path, file, {"model.norm.weight": None})
    with pytest.raises(HFCheckpointError, match=r"missing key 'model\.norm\.weight'"):
        load_hf_checkpoint(_materialized(cfg), tmp_path)


def test_fsdp2_sharded_model_loads_and_exports(tmp_path: Path) -> None:
    """The DTensor path: a world-size-1 gloo group is real, so fully_shard makes every parameter a DTensor."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    cfg = nemotron_config()
    hub = write_hub_checkpoint(cfg, tmp_path / "hub")
    plain = _materialized(cfg)
    load_hf_checkpoint(plain, tmp_path / "hub")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = build_model(cfg)
        for layer in model.model.layers:
            if layer.is_moe:
                fully_shard(layer.routed_moe().experts_module(), mesh=mesh)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        load_hf_checkpoint(model, tmp_path / "hub")
        assert all(isinstance(p, DTensor) for p in model.parameters())
        reference = plain.state_dict()
        for name, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), reference[name]), name
        export_hf_checkpoint(model, tmp_path / "out", dtype=torch.bfloat16)
    finally:
        dist.destroy_process_group()
    assert_bytes_equal(read_dir(tmp_path / "out"), hub)


def test_resolve_pretrained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Local directories pass through; anything else goes to huggingface_hub, whose failure (no network here)
    becomes a FileNotFoundError naming the id."""
    hub = pytest.importorskip("huggingface_hub")
    assert resolve_pretrained(tmp_path) == tmp_path
    requested: list[str] = []

    def offline(repo_id: str, **kwargs: object) -> str:
        requested.append(repo_id)
        raise OSError("offline")

    monkeypatch.setattr(hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match=r"zai-org/GLM-4\.5-Air: not a local directory and not downloadable"):
        resolve_pretrained("zai-org/GLM-4.5-Air")
    assert requested == ["zai-org/GLM-4.5-Air"]
