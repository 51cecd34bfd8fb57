"""HF-first loading and the one preflight, without torchrun: a local HF directory fills ``model.*``; explicit keys
win (noted), schema defaults never do; a family or weight-shape conflict fails naming the key; ``nemo-ac validate``
now runs the trainer's own checks (checkpoint paths, writable directories, compile backend); the config side
imports no torch; the export extras (tokenizer files, generation_config.json) are chosen as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_ac.cli import main as cli
from nemo_ac.config import ConfigError, load_recipe
from nemo_ac.config.hf import hf_config_dict
from nemo_ac.preflight import preflight
from nemo_ac.trainer.checkpoint.export_files import write_export_extras
from tests.factories import CONFIGS, write_hub_checkpoint
from tests.launch import RECIPES, ROOT

TINY = RECIPES / "tiny" / "qwen3_moe_tiny.yaml"


def _hf_dir(root: Path, family: str = "qwen3_moe", **changes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**hf_config_dict(CONFIGS[family]()), **changes}))
    return root


def _recipe(tmp_path: Path, model: str, extra: str = "") -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"name: t\nmodel:\n{model}\ntrain:\n  global_batch_size: 4\n  micro_batch_size: 2\n{extra}")
    return path


def test_local_dir_fills_the_architecture_and_explicit_keys_win(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path / "hf", num_hidden_layers=3, rms_norm_eps=1e-5, max_position_embeddings=300)
    notes: list[str] = []
    recipe = load_recipe(
        _recipe(tmp_path, f"  pretrained: {hf}\n  max_position_embeddings: 600\n  moe:\n    aux_loss_coef: 0.0"),
        ["model.init_std=0.5"],
        notes=notes,
    )
    expected = CONFIGS["qwen3_moe"]()
    m = recipe.model
    assert (m.family, m.num_layers, m.hidden_size, m.vocab_size) == ("qwen3_moe", 3, expected.hidden_size, 64)
    assert m.rms_norm_eps == 1e-5  # config.json's, not the schema default 1e-6
    assert (m.max_position_embeddings, m.init_std, m.moe.aux_loss_coef) == (600, 0.5, 0.0)  # explicit keys win
    assert m.moe.num_experts == expected.moe.num_experts and m.first_k_dense_replace == expected.first_k_dense_replace
    assert notes[1:] == [
        "model.max_position_embeddings: recipe 600 overrides config.json 300",
        f"model.init_std: recipe 0.5 overrides config.json {expected.init_std}",
    ]  # aux_loss_coef is a training knob no config.json holds: no note
    with pytest.raises(ConfigError, match=r"model.pretrained: .*/hf: no \*.safetensors files"):
        preflight(str(tmp_path / "recipe.yaml"), world_size=2, check_env=False)  # the preflight reads the headers
    write_hub_checkpoint(m, hf)
    assert preflight(str(tmp_path / "recipe.yaml"), world_size=2, check_env=False).recipe.model.num_layers == 3


def test_conflicts_fail_naming_the_key(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path / "hf")
    with pytest.raises(ConfigError) as info:
        load_recipe(_recipe(tmp_path, f"  pretrained: {hf}\n  family: glm4_moe"))
    assert info.value.keys == ["model.family"] and "remove model.family" in str(info.value)
    path = _recipe(tmp_path, f"  pretrained: {hf}\n  hidden_size: 48")
    load_recipe(path)  # the override itself loads (it is noted) ...
    assert cli(["validate", str(path), "--world-size", "1"]) == 2  # ... but cannot load these weights
    with pytest.raises(ConfigError) as info:
        preflight(str(path), world_size=1, check_env=False)
    assert info.value.keys == ["model.hidden_size"] and "remove model.hidden_size from the recipe" in str(info.value)


def test_validate_runs_the_trainers_path_checks(tmp_path: Path, capsys) -> None:
    """Checks only the trainer used to make (checkpoint paths), and the new writable-directory check."""
    missing = tmp_path / "ckpt" / "step_3"
    assert cli(["validate", str(TINY), "--world-size", "2", f"checkpoint.resume={missing}"]) == 2
    assert f"checkpoint.resume: '{missing}' does not exist" in capsys.readouterr().err
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert cli(["validate", str(TINY), "--world-size", "2", f"logging.run_dir={blocker / 'run'}"]) == 2
    assert f"logging.run_dir: '{blocker / 'run'}' cannot be created: {blocker} is a file" in capsys.readouterr().err
    overrides = ["compile.enabled=true", "compile.backend=no_such_backend"]
    assert cli(["validate", str(TINY), "--world-size", "2", *overrides]) == 0  # an environment question ...
    assert cli(["validate", str(TINY), "--world-size", "2", "--check-env", *overrides]) == 2  # ... asked here
    assert "compile.backend: 'no_such_backend' is not a registered torch.compile backend" in capsys.readouterr().err


def test_config_side_imports_no_torch() -> None:
    """Loading (config.json filling the architecture), the recipe rules and the checkpoint-side checks stay free of
    torch; ``preflight``'s plan step (the model on meta) is where torch comes in."""
    code = (
        "import sys; from nemo_ac.config import load_recipe, validate_recipe; "
        "from nemo_ac.config.pretrained import check_pretrained; "
        "r = load_recipe('recipes/qwen3_6_35b_medpix_ep8cp2_4k.yaml'); validate_recipe(r, world_size=8); "
        "assert not check_pretrained(r); "
        "assert r.model.num_layers == 40; assert 'torch' not in sys.modules, 'torch'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_export_extras_copy_the_tokenizer_and_derive_generation_config(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path / "hf", bos_token_id=1, eos_token_id=2)
    (hf / "tokenizer.json").write_text("{}")
    (hf / "tokenizer_config.json").write_text("{}")
    (hf / "model.safetensors").write_text("not copied")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    recipe = load_recipe(_recipe(tmp_path, f"  pretrained: {hf}"))
    lines = write_export_extras(recipe, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "_from_model_config": True,
    }
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    assert any("written from the token ids" in line for line in lines)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5], "temperature": 0.7}))
    write_export_extras(recipe, out)
    assert json.loads((out / "generation_config.json").read_text())["temperature"] == 0.7  # copied as published
    tiny = load_recipe(TINY)  # the byte tokenizer has no HF files: none copied, its ids in generation_config
    (tmp_path / "tiny").mkdir()
    assert any(line.startswith("tokenizer: none") for line in write_export_extras(tiny, tmp_path / "tiny"))
    assert json.loads((tmp_path / "tiny" / "generation_config.json").read_text())["eos_token_id"] == 5
