"""The Qwen3.6 MedPix recipes validate where they are meant to run and fail clearly elsewhere, before any process
group (``nemo-ac validate``, the command the README gives); ``make run`` runs the tiny one on 4 processes."""

from __future__ import annotations

import re
from pathlib import Path

from nemo_ac.cli import main
from nemo_ac.config import load_recipe

ROOT = Path(__file__).resolve().parents[3]
FLAGSHIP = str(ROOT / "recipes" / "qwen3_6_35b_medpix_ep8cp2_4k.yaml")
TINY = str(ROOT / "recipes" / "tiny" / "qwen3_6_medpix_tiny.yaml")


def test_flagship_validates_at_world_size_8(capsys):
    assert main(["validate", FLAGSHIP, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "OK at world size 8: dp_replicate 1 x dp_shard 4 x cp 2 (ulysses), ep 8 x ep_shard 1" in out


def test_flagship_fails_clearly_at_world_size_6(capsys):
    assert main(["validate", FLAGSHIP, "--world-size", "6"]) == 2
    err = capsys.readouterr().err
    assert "invalid recipe in" in err and "qwen3_6_35b_medpix_ep8cp2_4k.yaml" in err
    assert (
        "parallel: dp_replicate*dp_shard*cp = 1*4*2 = 8 must equal the world size 6: launch 8 processes for this "
        "layout" in err
    )
    # Letting dp_shard follow the world size does not rescue EP8 on 6 ranks either, and says why.
    assert main(["validate", FLAGSHIP, "--world-size", "6", "parallel.dp_shard=-1"]) == 2
    assert "parallel.ep: ep=8 must divide dp_shard*cp = 3*2 = 6" in capsys.readouterr().err


def test_flagship_has_the_issue_s_layout_and_switches():
    recipe = load_recipe(FLAGSHIP)
    assert (recipe.parallel.dp_shard, recipe.parallel.cp, recipe.parallel.ep) == (4, 2, 8)
    assert recipe.parallel.cp_type == "ulysses" and recipe.data.max_length == 4096
    assert recipe.activation_checkpointing.mode == "selective" and recipe.compile.enabled
    assert recipe.model.moe.router_dtype == "float32" and recipe.train.freeze.vision_tower
    assert recipe.backend.dispatcher == "torch" and recipe.backend.attention == "auto"  # FlexAttention on CUDA
    text = Path(FLAGSHIP).read_text()
    assert "backend.dispatcher=deepep" in text and "backend.attention=te" in text  # how to switch, in the recipe


def test_tiny_recipe_validates_on_4_ranks_and_is_what_make_run_runs(capsys):
    assert main(["validate", TINY, "--world-size", "4"]) == 0
    assert "OK at world size 4: dp_replicate 1 x dp_shard 2 x cp 2 (ulysses), ep 2 x ep_shard 2" in (
        capsys.readouterr().out
    )
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^RECIPE \?= recipes/tiny/qwen3_6_medpix_tiny\.yaml$", makefile, re.M)
    assert re.search(r"^NPROC \?= 4$", makefile, re.M)
