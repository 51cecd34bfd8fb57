"""Every family's state-dict names, shapes, initial values and logits stay as recorded.

The HF mapping (``nemo_ac.trainer.checkpoint.hf_safetensors``) and DCP checkpoints address parameters by name, and
``nemo_ac.models.init`` seeds each tensor from its name; a refactor of the model classes that renames, reorders
into another module, reshapes or re-inits a parameter would load or init silently wrong. The record in
``data/model_state_dicts.json`` was taken from the model code before the families shared one CausalLM base;
regenerate it (``python tests/unit/models/test_models_state_dict.py``) only for an intended rename, and say so in the
commit.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nemo_ac.config.schema import ModelConfig, VisionConfig
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from tests.factories import glm_config, nemotron_config, qwen3_5_config, qwen3_moe_config

RECORD = Path(__file__).parent / "data" / "model_state_dicts.json"
SEQ = 13  # two packed documents; no model dimension is 13


def _qwen3_5_vision_config() -> ModelConfig:
    vision = VisionConfig(depth=1, hidden_size=16, num_heads=2, intermediate_size=24, num_position_embeddings=4)
    return dataclasses.replace(qwen3_5_config(), vision=vision)


CASES: dict[str, Callable[[], ModelConfig]] = {
    "qwen3_moe": qwen3_moe_config,
    "glm4_moe": glm_config,
    "nemotron_h": nemotron_config,
    "qwen3_5_moe": qwen3_5_config,
    "qwen3_5_moe_vision": _qwen3_5_vision_config,
}


def _signature(cfg: ModelConfig) -> dict:
    """State-dict keys in order with shape and value sum after a seeded init, plus logits of a packed row."""
    model = materialize_and_init(build_model(cfg), device="cpu", seed=7)
    tensors = [[name, list(value.shape), float(value.double().sum())] for name, value in model.state_dict().items()]
    ids = torch.randint(4, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    documents = (torch.arange(SEQ) >= 6).to(torch.int64).unsqueeze(0)
    positions = torch.cat((torch.arange(6), torch.arange(SEQ - 6))).unsqueeze(0)
    with torch.no_grad():
        out = model(ids, position_ids=positions, attn=build_attention_inputs(documents))
    logits = out.logits.double()
    return {
        "state_dict": tensors,
        "logits_sum": float(logits.sum()),
        "logits_abs_sum": float(logits.abs().sum()),
        "router_layers": len(out.router_stats),
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_names_init_and_logits_as_recorded(case: str) -> None:
    want = json.loads(RECORD.read_text())[case]
    got = _signature(CASES[case]())
    assert [name for name, _, _ in got["state_dict"]] == [name for name, _, _ in want["state_dict"]]
    for (name, shape, total), (_, want_shape, want_total) in zip(got["state_dict"], want["state_dict"], strict=True):
        assert shape == want_shape, name
        assert total == pytest.approx(want_total, rel=1e-6, abs=1e-6), name
    assert got["router_layers"] == want["router_layers"]
    assert got["logits_sum"] == pytest.approx(want["logits_sum"], rel=1e-5, abs=1e-5)
    assert got["logits_abs_sum"] == pytest.approx(want["logits_abs_sum"], rel=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tied_embeddings_share_one_tensor(case: str) -> None:
    cfg = dataclasses.replace(CASES[case](), tie_word_embeddings=True)
    model = materialize_and_init(build_model(cfg), device="cpu", seed=0)
    embedding = model.get_input_embeddings()
    assert model.lm_head.weight is embedding.weight
    assert embedding.weight.shape == (cfg.vocab_size, cfg.hidden_size)


def _write_record() -> None:
    """One line per tensor, so a diff of the record names each changed parameter."""
    lines = []
    for case, make in sorted(CASES.items()):
        signature = _signature(make())
        rows = ",\n".join(f"   {json.dumps(row)}" for row in signature.pop("state_dict"))
        scalars = "".join(f',\n  "{key}": {json.dumps(value)}' for key, value in signature.items())
        lines.append(f' "{case}": {{\n  "state_dict": [\n{rows}\n  ]{scalars}\n }}')
    RECORD.write_text("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__":
    _write_record()
