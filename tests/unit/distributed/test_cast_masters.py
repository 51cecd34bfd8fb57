"""``train.master_dtype: bfloat16``: what ``fsdp.cast_masters`` casts before ``fully_shard`` (the dtype FSDP then
shards, the optimizer updates and the gradients are kept in), and what it leaves alone."""

from __future__ import annotations

from pathlib import Path

import torch

from nemo_ac.config import load_recipe
from nemo_ac.distributed.fsdp import cast_masters
from nemo_ac.models import build_model

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def test_floating_parameters_are_cast_but_an_fp32_router_and_the_buffers_stay() -> None:
    recipe = load_recipe(RECIPES / "tiny/glm_4_5_air_tiny.yaml")  # router_dtype float32, a correction-bias buffer
    with torch.device("meta"):
        model = build_model(recipe.model)
    buffers = {name: buffer.dtype for name, buffer in model.named_buffers()}
    routers = {name for name, module in model.named_modules() if getattr(module, "keep_fp32", False)}
    assert routers, "the tiny GLM recipe routes in fp32"
    count = cast_masters(model, torch.bfloat16)
    dtypes = {name: param.dtype for name, param in model.named_parameters()}
    kept = {name for name in dtypes if name.rpartition(".")[0] in routers}
    assert kept and {dtypes[name] for name in kept} == {torch.float32}
    assert {dtype for name, dtype in dtypes.items() if name not in kept} == {torch.bfloat16}
    assert count == len(dtypes) - len(kept)
    assert {name: buffer.dtype for name, buffer in model.named_buffers()} == buffers  # RoPE, correction bias
    assert torch.float32 in buffers.values()
    assert cast_masters(model, torch.bfloat16) == 0  # nothing left to cast


def test_tied_embeddings_stay_one_parameter() -> None:
    recipe = load_recipe(RECIPES / "tiny/qwen3_moe_tiny.yaml", ["model.tie_word_embeddings=true"])
    with torch.device("meta"):
        model = build_model(recipe.model)
    model.tie_weights()
    cast_masters(model, torch.bfloat16)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # no copy split the tie
    assert model.lm_head.weight.dtype == torch.bfloat16
