"""``activation_checkpointing.by_block``: a mode per block kind, decided in the plan, applied by the same steps.

The tiny Nemotron-H recipe has three block kinds (``ssm``, ``moe``, ``softmax_attention``): each gets the mode its
key names, the rest the recipe's ``mode``, and the gradients equal the run without AC bitwise (FSDP2 over gloo at
world size 1: AC only decides whether a value is kept or recomputed, and every CPU kernel is deterministic). A key
no block has is refused before anything is built, naming the model's kinds.
"""

from __future__ import annotations

import pytest
import torch

from nemo_ac.config import ConfigError, load_recipe, validate_recipe
from nemo_ac.distributed.plan import ACMode
from nemo_ac.models.init import canonical_name, materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.trainer.build import build_parallel_model, plan_recipe
from tests.launch import RECIPES

pytestmark = pytest.mark.usefixtures("world")

NEMOTRON = RECIPES / "tiny" / "nemotron_super_v3_tiny.yaml"
SINGLE_RANK = ["parallel.ep=1", "parallel.cp=1"]
MIXED = [
    "activation_checkpointing.mode=full",
    "+activation_checkpointing.by_block.ssm=none",
    "+activation_checkpointing.by_block.moe=selective",
]


def _recipe(overrides: list[str]):
    recipe = load_recipe(str(NEMOTRON), SINGLE_RANK + overrides)
    return recipe, validate_recipe(recipe, world_size=1)


def _grads(overrides: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    recipe, layout = _recipe(overrides)
    model, _, _ = build_parallel_model(recipe, layout, device=torch.device("cpu"))
    materialize_and_init(model, device="cpu", seed=5)
    ids = torch.randint(0, recipe.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    docs = torch.cat([torch.zeros(2, 9, dtype=torch.long), torch.ones(2, 15, dtype=torch.long)], 1)  # two documents
    positions = torch.cat([torch.arange(9), torch.arange(15)]).expand(2, -1)
    out = model(ids, position_ids=positions, attn=build_attention_inputs(docs))
    loss = out.logits.float().logsumexp(-1).mean() + sum(s.prob_sum.sum() for s in out.router_stats) * 1e-3
    loss.backward()
    grads = {canonical_name(n): p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def test_each_block_kind_gets_its_mode_in_the_plan() -> None:
    recipe, layout = _recipe(MIXED)
    plan = plan_recipe(recipe, layout, device_type="cpu", torch_version="2.13.0")
    modes = {(block.mixers, block.moe): block.ac for block in plan.decoder_blocks()}
    assert modes == {
        (("ssm",), False): ACMode.NONE,
        ((), True): ACMode.SELECTIVE,
        (("softmax_attention",), False): ACMode.FULL,  # not named: the recipe's mode
    }
    # A selective block switches SAC's fixes on although the recipe's mode is full.
    assert {"profiler_ops_in_sac", "fsdp_hooks_in_sac"} <= set(plan.workarounds)


def test_mixed_modes_train_bitwise_like_no_ac() -> None:
    expected_loss, expected = _grads(["activation_checkpointing.mode=none"])
    loss, grads = _grads(MIXED)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_a_kind_the_model_lacks_is_refused_naming_its_kinds() -> None:
    recipe, layout = _recipe(["+activation_checkpointing.by_block.linear_attention=none"])
    with pytest.raises(ConfigError) as info:
        plan_recipe(recipe, layout, device_type="cpu")
    (issue,) = info.value.issues
    assert issue.key == "activation_checkpointing.by_block"
    assert "'linear_attention' names no block of this model; its blocks are moe, softmax_attention, ssm" in str(issue)


def test_a_mode_outside_the_choices_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.by_block\.ssm.*'sometimes' is not valid"):
        load_recipe(str(NEMOTRON), ["+activation_checkpointing.by_block.ssm=sometimes"])
