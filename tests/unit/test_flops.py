"""MFU's two inputs: the datasheet peak per GPU name (first match wins) and model FLOPs per token."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_ac.config import load_recipe
from nemo_ac.models import build_model
from nemo_ac.trainer.flops import TERA, gpu_peak, measure_cpu_peak, model_flops_per_token
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
