"""HF-first end to end: a tiny Hugging Face model directory made by transformers itself (``save_pretrained`` of a
Qwen3-MoE plus a tokenizer built offline with ``tokenizers``) trains from a recipe with ``model.pretrained`` and no
architecture key (real torchrun, 2 gloo ranks, DCP checkpoint); ``nemo-ac export`` turns the checkpoint into a model
directory that ``transformers`` loads and generates from, with the logits of nemo_ac's own model on those weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from nemo_ac.cli import main as cli
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.trainer.checkpoint.export import find_checkpoint, load_checkpoint_model, recipe_of
from tests.launch import run_recipe

pytestmark = pytest.mark.functional
transformers = pytest.importorskip("transformers", reason="the HF-first round trip needs transformers")
tokenizers = pytest.importorskip("tokenizers", reason="the offline tokenizer needs the tokenizers library")
load_file = pytest.importorskip("safetensors.torch", reason="HF checkpoints need safetensors").load_file

VOCAB = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]  # 64 ids: the synthetic tasks need >= 8


def make_tiny_hf_model(root: Path) -> Path:
    """A Qwen3-MoE model directory as the Hub has them: config.json, safetensors, generation_config.json and a fast
    tokenizer, all written by transformers (no network)."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[0],
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root)
    fast.save_pretrained(root)
    return root


RECIPE = """\
# model.pretrained and nothing else under model: the architecture is the checkpoint's config.json.
name: qwen3_moe_from_pretrained
model:
  pretrained: {pretrained}
parallel:
  dp_shard: -1
data:
  task: sort
  seq_len: 40
  min_doc_tokens: 3
  max_doc_tokens: 8
train:
  steps: 3
  global_batch_size: 4
  micro_batch_size: 2
  lr: 0.01
  warmup_steps: 1
checkpoint:
  enabled: true
"""


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, position_ids=pos, attn=build_attention_inputs(torch.zeros_like(ids))).logits


def test_pretrained_dir_trains_and_exports_to_transformers(tmp_path: Path, capsys) -> None:
    pretrained = make_tiny_hf_model(tmp_path / "tiny_qwen3_moe")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(pretrained=pretrained))
    assert "num_hidden_layers" not in recipe.read_text() and "hidden_size" not in recipe.read_text()

    assert cli(["validate", str(recipe), "--world-size", "2", "model.max_position_embeddings=1024"]) == 0
    out = capsys.readouterr().out
    assert f"architecture from {pretrained / 'config.json'} (family qwen3_moe)" in out
    assert "note | model.max_position_embeddings: recipe 1024 overrides config.json 512" in out

    run = run_recipe(recipe, nproc=2, run_dir=tmp_path / "run").check()
    assert len(run.losses) == 3 and all(0 < loss < 10 for loss in run.losses), run.losses
    assert f"weights from {pretrained}" in run.output and "no recipe overrides" in run.output

    exported = tmp_path / "exported"
    assert cli(["export", str(tmp_path / "run"), "--out", str(exported)]) == 0
    assert "export | step 3 of" in capsys.readouterr().out
    names = sorted(p.name for p in exported.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "nemo_ac_export.json",  # the marker that lets a later export replace this directory (docs/checkpoints.md)
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((exported / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["eos_token_id"]) == ("qwen3_moe", 2, 2)

    tok = transformers.AutoTokenizer.from_pretrained(exported)
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = tok("w3 w1 w4 w1 w5 w9 w2", return_tensors="pt").input_ids
    generated = hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 4) and torch.equal(generated[:, : ids.shape[1]], ids)

    # The exported weights are the checkpoint's, read here independently of the export (DCP -> torch.save), and
    # those are the pretrained ones after 3 AdamW steps (each moves a weight by about lr = 0.01 at most; a random
    # init would sit ~0.1 away from the pretrained weights somewhere in the matrix).
    checkpoint = find_checkpoint(tmp_path / "run")
    dcp_to_torch_save(checkpoint, tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    hub = load_file(exported / "model.safetensors")
    original = load_file(pretrained / "model.safetensors")
    for key in ("lm_head.weight", "model.layers.1.mlp.experts.0.down_proj.weight"):
        trained = saved[key] if key in saved else saved["model.layers.1.mlp.experts.down_proj"][0]
        torch.testing.assert_close(hub[key], trained, rtol=0, atol=0)
        moved = (hub[key] - original[key]).abs().max().item()
        assert 0 < moved < 0.05, (key, moved)
    # nemo_ac's own model on the checkpoint gives transformers' logits on the export.
    ours = load_checkpoint_model(recipe_of(checkpoint), checkpoint)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(_logits(ours, ids), ref, atol=1e-4, rtol=1e-4)
