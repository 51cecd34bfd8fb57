"""The nemo-ac console script: validate checks a recipe for a world size without starting anything; train's
multi-node flags; recipes, --version; the shipped recipes in the wheel; the SLURM template."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_ac.cli import main
from nemo_ac.config.recipes import recipes_root

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
TINY = str(RECIPES / "tiny" / "qwen3_moe_tiny.yaml")


def test_validate_ok(capsys):
    assert main(["validate", TINY, "--world-size", "2"]) == 0
    assert "OK at world size 2: dp_replicate 1 x dp_shard 2 x cp 1" in capsys.readouterr().out


def test_validate_plan_prints_the_plan_of_the_flagship_without_a_gpu(capsys):
    """The Nemotron recipe at 64 ranks: every TE block is AC(compile(block)), with its graph breaks named."""
    assert main(["validate", str(RECIPES / "nemotron_super_v3_te_deepep.yaml"), "--world-size", "64", "--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("kernels | experts grouped_mm") and "mamba torch" in lines[1]  # no linear_attention
    assert "linear_attention" not in lines[1]
    assert lines[2].startswith("plan | ep 64 (deepep)") and "backend.linear te | backend.rms_norm te" in lines[2]
    blocks = [line for line in lines if "model.layers." in line]
    assert len(blocks) == 3 and all("compile ac_outer (graph breaks at te.Linear x" in line for line in blocks)
    assert sum(int(line.split(") |")[0].rsplit("(", 1)[1]) for line in blocks) == 88


def test_validate_with_overrides_reports_every_problem(capsys):
    assert main(["validate", TINY, "train.stepz=3", "--world-size", "4"]) == 2
    assert "train.stepz: unknown key. Did you mean 'train.steps'?" in capsys.readouterr().err
    assert main(["validate", TINY, "--world-size", "4", "parallel.cp=3", "model.moe.num_experts=6"]) == 2
    err = capsys.readouterr().err
    assert "parallel.dp_shard: world size 4 is not divisible by dp_replicate*cp = 1*3" in err
    assert "parallel.cp: ulysses CP splits attention heads: num_attention_heads=4 must be divisible by cp=3" in err


def test_train_validates_before_launching(capsys):
    assert main(["train", TINY, "--nproc-per-node", "3", "train.global_batch_size=8"]) == 2
    assert "train.global_batch_size: 8 must be divisible by dp*micro_batch_size = 3*2" in capsys.readouterr().err


def test_train_on_several_nodes_needs_a_rendezvous_endpoint(capsys, monkeypatch):
    launched = []
    monkeypatch.setattr("os.execvpe", lambda file, command, env: launched.append(command) or 0)
    assert main(["train", TINY, "--nnodes", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--nnodes 2 needs --rdzv-endpoint HOST:PORT" in err
    assert not launched


def test_train_on_several_nodes_passes_the_rendezvous_to_torchrun(monkeypatch):
    launched = []
    # `nemo-ac train` becomes torchrun (os.execvpe: signals reach it directly); here the exec only records.
    monkeypatch.setattr("os.execvpe", lambda file, command, env: launched.append(command) or 0)
    args = ["train", TINY, "--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "77", "train.steps=3"]
    assert main(args) == 0
    (command,) = launched
    assert command[1:3] == ["-m", "nemo_ac.launch"]  # torchrun with one-line endings
    assert "--standalone" not in command
    assert command[4:8] == ["--nnodes=2", "--rdzv-endpoint=node0:29500", "--rdzv-backend=c10d", "--rdzv-id=77"]
    assert command[-2:] == [TINY, "train.steps=3"]
    assert main(["train", TINY, "--nproc-per-node", "2"]) == 0  # one node: --standalone, no endpoint needed
    assert "--standalone" in launched[-1]


def test_recipes_lists_every_shipped_recipe_with_its_description(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    shipped = sorted(RECIPES.rglob("*.yaml"))
    assert shipped and all(str(path.relative_to(RECIPES).with_suffix("")) in out for path in shipped)
    assert re.search(
        r"^tiny/qwen3_moe_tiny +Tiny Qwen3-MoE-style decoder on the synthetic sort task: the spine", out, re.M
    )
    assert str(Path("nemo_ac") / "recipes" / "tiny" / "qwen3_moe_tiny.yaml") in out


def test_a_shipped_recipe_name_works_where_a_path_is_expected(capsys):
    assert main(["validate", "tiny/qwen3_moe_tiny", "--world-size", "2"]) == 0
    assert "OK at world size 2" in capsys.readouterr().out
    assert main(["validate", "tiny/no_such_recipe", "--world-size", "2"]) == 2
    assert "recipe file 'tiny/no_such_recipe' does not exist" in capsys.readouterr().err


def test_version(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"nemo-ac {importlib.metadata.version('nemo_ac')}"


def test_the_wheel_ships_every_recipe():
    """pyproject's package-data globs (through the nemo_ac/recipes link) cover every YAML under recipes/."""
    import fnmatch
    import tomllib

    assert (ROOT / "nemo_ac" / "recipes").resolve() == RECIPES
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["nemo_ac"]
    for path in RECIPES.rglob("*"):
        if path.is_file():
            rel = str(Path("recipes") / path.relative_to(RECIPES))
            assert any(fnmatch.fnmatch(rel, p) and rel.count("/") == p.count("/") for p in patterns), rel


def test_the_wheel_ships_the_tiny_corpora_and_a_recipe_finds_them_outside_a_checkout(tmp_path, monkeypatch, capsys):
    """The tiny text recipes name ``data/tiny_corpus.jsonl`` (cwd-relative). The wheel carries data/ through the
    nemo_ac/shipped_data link; from another directory the shipped copy is used, with a note; a file of that name in
    the working directory wins."""
    import fnmatch
    import tomllib

    assert (ROOT / "nemo_ac" / "shipped_data").resolve() == ROOT / "data"
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["nemo_ac"]
    for path in (ROOT / "data").iterdir():
        assert any(fnmatch.fnmatch(f"shipped_data/{path.name}", p) for p in patterns), path.name

    from nemo_ac.config.load import load_recipe

    monkeypatch.chdir(tmp_path)
    notes: list[str] = []
    recipe = load_recipe(RECIPES / "tiny" / "nemotron_super_v3_tiny.yaml", notes=notes)
    assert Path(recipe.data.path) == ROOT / "data" / "tiny_corpus.jsonl"
    assert any(note.startswith("data.path: data/tiny_corpus.jsonl is not in the working directory") for note in notes)
    assert main(["validate", "tiny/nemotron_super_v3_tiny", "--world-size", "2"]) == 0
    assert "note | data.path: data/tiny_corpus.jsonl is not in the working directory" in capsys.readouterr().out

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tiny_corpus.jsonl").write_text('{"text": "own corpus"}\n')
    notes = []
    assert (
        load_recipe(RECIPES / "tiny" / "nemotron_super_v3_tiny.yaml", notes=notes).data.path == "data/tiny_corpus.jsonl"
    )
    assert not notes
    missing = load_recipe(RECIPES / "tiny" / "nemotron_super_v3_tiny.yaml", ["data.path=data/absent.jsonl"])
    assert missing.data.path == "data/absent.jsonl"  # not shipped: left for the data source to report


def test_slurm_template_parses_and_launches_one_torchrun_per_node(tmp_path):
    """bash -n, then the script itself with stand-ins for scontrol and srun (which record the command)."""
    script = ROOT / "scripts" / "slurm" / "nemo_ac.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "RECIPE=${RECIPE:-" in text and '-m nemo_ac.train "$RECIPE"' in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a07\\ngpu-a08\\n"\n')
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/srun_args\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "RECIPE": "tiny/qwen3_moe_tiny",
        "SLURM_JOB_NODELIST": "gpu-a[07-08]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "GPUS_PER_NODE": "2",
    }
    proc = subprocess.run(["bash", str(script), "train.steps=5"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "OK at world size 4" in proc.stdout
    args = (tmp_path / "srun_args").read_text().splitlines()
    assert args[:2] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    joined = " ".join(args)
    assert "--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint gpu-a07:29500 --rdzv-id 4242" in joined
    assert args[-3:] == ["nemo_ac.train", str(recipes_root() / "tiny" / "qwen3_moe_tiny.yaml"), "train.steps=5"]
