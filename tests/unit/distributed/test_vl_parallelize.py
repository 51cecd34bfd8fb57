"""The vision-language family through nemo_ac's parallelizer and batch preparer, in one process (gloo world size 1,
a real process group): where the blocks are, what becomes an FSDP unit / AC region / compiled region, and the
embed-then-shard path context parallel uses (vision on the full rows, then each CP rank's slice)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.data.sources import build_batches
from nemo_ac.distributed.blocks import decoder_layers, decoder_layers_path, unwrap_block, vision_blocks
from nemo_ac.distributed.compile import is_compiled
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.trainer.batching import make_batch_preparer
from nemo_ac.trainer.build import build_parallel_model
from tests.launch import RECIPES

pytest.importorskip("PIL", reason="MedPix images need pillow (the hf extra)")
pytestmark = pytest.mark.usefixtures("world", "private_sac_ignored_ops")

VL = RECIPES / "tiny" / "qwen3_6_medpix_tiny.yaml"
# World size 1: no EP / CP process groups; the CP preparer below only slices (it runs no collective).
ONE_RANK = ["parallel.cp=1", "parallel.ep=1", "train.micro_batch_size=2"]


def _parallelized(*overrides: str):
    recipe = load_recipe(VL, [*ONE_RANK, *overrides])
    layout = validate_recipe(recipe, world_size=1)
    model, _, plan = build_parallel_model(recipe, layout, device=torch.device("cpu"))
    return recipe, materialize_and_init(model, device="cpu", seed=recipe.train.seed), plan


def _batch(recipe):
    data = build_batches(
        recipe.data,
        vocab_size=recipe.model.vocab_size,
        vision=recipe.model.vision,
        global_batch_size=recipe.train.global_batch_size,
        micro_batch_size=recipe.train.micro_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=recipe.train.seed,
    )
    return data.batches_for_step(0)[0]


def test_block_lists_of_text_and_vision_language_models():
    recipe = load_recipe(VL, ONE_RANK)
    vl = build_model(recipe.model)
    assert decoder_layers_path(vl) == "model.language_model.layers"
    assert decoder_layers(vl) is vl.model.language_model.layers
    assert vision_blocks(vl) is vl.model.visual.blocks
    text = build_model(load_recipe(RECIPES / "tiny" / "qwen3_moe_tiny.yaml").model)
    assert decoder_layers_path(text) == "model.layers" and vision_blocks(text) is None
    with pytest.raises(TypeError, match=r"Linear does not implement nemo_ac.models.interfaces.ParallelizableModel"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_vision_blocks_are_fsdp_units_and_ac_regions_but_never_compiled():
    _, model, plan = _parallelized()  # the recipe's selective AC + compile
    (vision_block,) = vision_blocks(model)
    assert isinstance(vision_block, CheckpointWrapper) and isinstance(vision_block, FSDPModule)
    assert not is_compiled(unwrap_block(vision_block)) and not is_compiled(vision_block)
    assert [b.compile_layout for b in plan.vision_blocks()] == [None]
    assert plan.compile_layouts() == ["ac_outer"] * len(decoder_layers(model))
    for layer in decoder_layers(model):  # both hybrid layer types: AC(compile(block)) around nested units
        assert isinstance(layer, CheckpointWrapper) and isinstance(layer, FSDPModule)
        assert is_compiled(unwrap_block(layer))
        assert isinstance(unwrap_block(layer).mlp.experts, FSDPModule)
    # The root unit unshards for the full-sequence embedding too (registered FSDP forward method).
    assert model.embed_inputs.__func__ is not type(model).embed_inputs


@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_preparer_embeds_the_full_rows_then_keeps_this_ranks_slice(cp_size: int):
    """Each CP rank's decoder inputs are its slice of the full-row embedding (image features where the placeholders
    are, M-RoPE positions of the whole document); the slices tile the full rows."""
    recipe, model, _ = _parallelized("compile.enabled=false", "activation_checkpointing.mode=none")
    batch = _batch(recipe)
    assert batch.pixel_values is not None and batch.input_ids.shape[1] % cp_size == 0
    full = model.embed_inputs(
        batch.input_ids,
        position_ids=batch.position_ids,
        document_ids=batch.document_ids,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
    )
    assert not torch.equal(full.position_ids[0], full.position_ids[1])  # images have 2D positions
    embeds, positions, labels = [], [], []
    for rank in range(cp_size):
        prepared = make_batch_preparer(cp=cp_size, cp_rank=rank, cp_type="ulysses")(batch)
        assert prepared.model_inputs["input_ids"] is None and "pixel_values" not in prepared.model_inputs
        inputs = prepared.inputs_for(model)
        embeds.append(inputs["inputs_embeds"])
        positions.append(inputs["position_ids"])
        labels.append(prepared.labels)
        assert inputs["attn"] is prepared.model_inputs["attn"]
    torch.testing.assert_close(torch.cat(embeds, dim=1), full.inputs_embeds, rtol=0, atol=0)
    assert torch.equal(torch.cat(positions, dim=-1), full.position_ids)
    assert torch.equal(torch.cat(labels, dim=1), batch.labels)


def test_without_cp_the_model_embeds_in_its_own_forward():
    recipe, model, _ = _parallelized("compile.enabled=false")
    batch = _batch(recipe)
    prepared = make_batch_preparer(cp=1)(batch)
    assert prepared.embed is None and prepared.inputs_for(model) is prepared.model_inputs
    assert prepared.model_inputs["pixel_values"] is batch.pixel_values
    output = model(**prepared.inputs_for(model))
    assert output.logits.shape == (*batch.input_ids.shape, recipe.model.vocab_size)
