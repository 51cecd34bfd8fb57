"""MFU's two inputs: the datasheet peak per GPU name (first match wins) and model FLOPs per token."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_ac.config import load_recipe
from nemo_ac.models import build_model
from nemo_ac.trainer.flops import TERA, attention_row_length, gpu_peak, measure_cpu_peak, model_flops_per_token
from tests.launch import RECIPES


@pytest.mark.parametrize(
    ("name", "dtype", "tflops", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4, "H100"),
        ("NVIDIA H100 NVL", torch.bfloat16, 835.0, "H100 NVL"),
        ("NVIDIA H100 PCIe", torch.float32, 51.2, "H100 PCIe"),
        ("NVIDIA H200", torch.bfloat16, 989.4, "H200"),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5, "A100"),
        ("NVIDIA B200", torch.bfloat16, 2250.0, "B200"),
        ("NVIDIA L40S", torch.bfloat16, 362.05, "L40S"),
        ("NVIDIA L4", torch.float16, 121.0, "L4"),
        ("NVIDIA GH200 480GB", torch.bfloat16, 989.4, "GH200"),
        ("NVIDIA GB200", torch.bfloat16, 2500.0, "GB200"),
    ],
)
def test_gpu_peaks_match_the_most_specific_entry(name, dtype, tflops, entry):
    peak = gpu_peak(name, dtype)
    assert peak is not None and peak.flops == tflops * TERA and peak.source.startswith(f"datasheet {entry} ")


def test_tf32_and_unknown_gpus():
    assert gpu_peak("NVIDIA A100-SXM4-40GB", torch.float32, allow_tf32=True).flops == 156.0 * TERA
    assert gpu_peak("Some Future GPU", torch.bfloat16) is None
    assert gpu_peak("NVIDIA A10G", torch.bfloat16) is None  # not the A10's datasheet: no guess


def test_cpu_peak_is_measured():
    peak = measure_cpu_peak(torch.float32, size=64, seconds=0.05)
    assert peak.flops > 0 and peak.source == "measured float32 matmul 64^3"


def test_model_flops_per_token_counts_active_experts_and_attention():
    recipe = load_recipe(str(RECIPES / "tiny/qwen3_moe_tiny.yaml"), [])
    cfg, moe = recipe.model, recipe.model.moe
    model = build_model(cfg)
    experts = sum(
        p.numel() for block in model.decoder_blocks() for p in block.routed_moe().experts_module().parameters()
    )
    embedding = cfg.vocab_size * cfg.hidden_size
    total = sum(p.numel() for p in model.parameters())
    active = total - embedding - experts + experts * moe.num_experts_per_tok / moe.num_experts
    attention = 12 * cfg.num_layers * cfg.num_attention_heads * cfg.head_dim * recipe.data.seq_len
    assert model_flops_per_token(model, recipe) == pytest.approx(6 * active + attention)
    # One more expert per token adds exactly its share of the expert weights.
    more = dataclasses.replace(moe, num_experts_per_tok=moe.num_experts_per_tok + 1)
    wider = dataclasses.replace(recipe, model=dataclasses.replace(cfg, moe=more))
    extra = model_flops_per_token(model, wider) - model_flops_per_token(model, recipe)
    assert extra == pytest.approx(6 * experts / moe.num_experts)


def test_medpix_attention_is_counted_at_the_rows_max_length_not_seq_len():
    """MedPix rows are ``data.max_length`` tokens; ``data.seq_len`` is unused there (the Qwen3.6 flagship's 4096-token
    rows were counted at its default of 64)."""
    recipe = load_recipe(str(RECIPES / "tiny/qwen3_6_medpix_tiny.yaml"), [])
    model = build_model(recipe.model, device="meta")

    def flops(**data: int) -> float:
        return model_flops_per_token(model, dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, **data)))

    base = flops()
    assert flops(seq_len=recipe.data.seq_len * 4) == base
    one_row_more = flops(max_length=2 * recipe.data.max_length) - base
    assert one_row_more > 0
    assert flops(max_length=3 * recipe.data.max_length) - base == pytest.approx(2 * one_row_more)


def test_row_length_of_each_data_kind():
    synthetic = load_recipe(str(RECIPES / "tiny/qwen3_moe_tiny.yaml"), []).data
    assert attention_row_length(dataclasses.replace(synthetic, seq_len=96, fixed_length=True)) == 96
    # Rows of 32, 40, 48, 56 or 64 tokens, one length per step: a token sees sum(S^2) / sum(S) positions.
    varying = dataclasses.replace(synthetic, seq_len=64, fixed_length=False, pad_multiple=8)
    assert attention_row_length(varying) == pytest.approx(12160 / 240)
    text = dataclasses.replace(synthetic, kind="text", seq_len=128, max_length=4096)
    assert attention_row_length(text) == 128
    medpix = dataclasses.replace(synthetic, kind="medpix", seq_len=64, max_length=4096)
    assert attention_row_length(medpix) == 4096
