"""Where an HF export may go (nemo_ac/trainer/checkpoint/export_target.py) and the preflight's check of
``checkpoint.export_hf_dir``: an export replaces its directory whole, so a target that is, contains or lies inside
what is being read or kept, a non-empty directory no export wrote, or an unwritable location is refused before
anything is loaded (measured before: ``nemo-ac export RUN --out RUN`` deleted the run's recipe, metrics and
checkpoints; an ``--out`` of unrelated files was emptied silently)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nemo_ac.config import load_recipe
from nemo_ac.preflight import check_export_dir
from nemo_ac.trainer.checkpoint.export_target import (
    EXPORT_MARKER,
    checkpoint_entry,
    is_export_dir,
    marker_text,
    overlap,
    replace_refusal,
    swap_in,
    write_blocker,
)

RECIPE = Path(__file__).resolve().parents[4] / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "x"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "recipe.yaml").write_text("name: x\n")
    return run


def test_overlap_is_contains_inside_through_symlinks_and_relative_paths(tmp_path, monkeypatch) -> None:
    run = _run(tmp_path)
    protected = [("the checkpoint directory", run / "checkpoints"), ("the run directory", run)]
    found = overlap(run, protected)
    assert (found.relation, found.what, found.describe(run)) == ("is", "the run directory", "is the run directory")
    assert overlap(run / "checkpoints", protected).describe(run / "checkpoints") == "is the checkpoint directory"
    found = overlap(tmp_path / "runs", protected)  # exact matches first, then what it contains
    assert found.describe(tmp_path / "runs") == f"contains the checkpoint directory {run / 'checkpoints'}"
    assert overlap(run / "hf", protected).describe(run / "hf") == f"lies inside the run directory {run}"
    assert overlap(run / "hf", protected, inside=False) is None
    assert overlap(tmp_path / "elsewhere", protected) is None
    (tmp_path / "link").symlink_to(run)
    assert overlap(tmp_path / "link", protected).relation == "is"  # resolved, not compared as text
    monkeypatch.chdir(run / "checkpoints")
    assert overlap(Path(".."), protected).relation == "is"
    assert overlap(Path("../../x/./hf"), protected).relation == "lies inside"


def test_checkpoint_entries_are_never_an_export_target(tmp_path) -> None:
    root = _run(tmp_path) / "checkpoints"
    assert checkpoint_entry(root / "step_2", root) == "step_2"
    assert checkpoint_entry(root / "step_2" / "hf", root) == "step_2"
    assert checkpoint_entry(root / ".step_3.partial", root) == ".step_3.partial"
    assert checkpoint_entry(root / "latest", root) == "latest"
    assert checkpoint_entry(root / "hf", root) is None  # the default <checkpoint.dir>/hf
    assert checkpoint_entry(root, root) is None and checkpoint_entry(tmp_path / "hf", root) is None


def test_replace_refusal_allows_new_empty_and_earlier_exports_only(tmp_path) -> None:
    assert replace_refusal(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert replace_refusal(tmp_path / "empty") is None
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (mine / name).write_text("keep me")
    refusal = replace_refusal(mine)
    assert refusal.startswith("is not empty (a.txt, b.txt, c.txt and 1 more) and holds no earlier nemo_ac export")
    assert replace_refusal(mine, force=True) is None
    (mine / EXPORT_MARKER).write_text("{}")  # a marker must be the one an export writes, not any file of that name
    assert not is_export_dir(mine) and replace_refusal(mine) is not None
    (mine / EXPORT_MARKER).write_text(marker_text(source="/ckpt/step_2", step=2))
    assert is_export_dir(mine) and replace_refusal(mine) is None
    (tmp_path / "file").write_text("x")
    assert replace_refusal(tmp_path / "file", force=True) == "is a file, not a directory"
    (tmp_path / "link").symlink_to(mine)
    assert replace_refusal(tmp_path / "link", force=True).startswith("is a symbolic link to")


def test_write_blocker_probes_and_leaves_nothing_behind(tmp_path) -> None:
    assert write_blocker(tmp_path / "a" / "b" / "hf") is None  # the nearest existing parent is probed
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the probe is gone, no parent was created
    (tmp_path / "file").write_text("x")
    assert write_blocker(tmp_path / "file" / "hf") == f"cannot be created: {tmp_path / 'file'} is a file"
    if os.geteuid() != 0:  # root writes through permission bits (the read-only mount case is in the functional test)
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            assert write_blocker(ro / "hf") == f"{ro} is not writable (Permission denied)"
        finally:
            ro.chmod(0o755)


def test_swap_in_replaces_the_old_export_and_keeps_it_when_the_rename_fails(tmp_path) -> None:
    out, partial = tmp_path / "hf", tmp_path / ".hf.partial"
    out.mkdir()
    (out / "old.safetensors").write_text("old")
    partial.mkdir()
    (partial / "new.safetensors").write_text("new")
    swap_in(partial, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (out / "new.safetensors").exists()
    with pytest.raises(FileNotFoundError):  # a partial that is gone: the rename fails after the old one moved aside
        swap_in(partial, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (out / "new.safetensors").read_text() == "new"


def _issues(tmp_path: Path, *overrides: str) -> list[str]:
    recipe = load_recipe(
        RECIPE,
        [f"logging.run_dir={tmp_path / 'run'}", "checkpoint.enabled=true", "checkpoint.export_hf=true", *overrides],
    )
    return [str(issue) for issue in check_export_dir(recipe)]


def test_preflight_refuses_an_export_dir_that_would_delete_the_run_a_checkpoint_or_unrelated_files(tmp_path) -> None:
    run = tmp_path / "run"
    assert _issues(tmp_path) == []  # the default <checkpoint.dir>/hf
    (issue,) = _issues(tmp_path, f"checkpoint.export_hf_dir={run}")
    assert issue == (
        f"checkpoint.export_hf_dir: '{run}' is the run directory (logging.run_dir); the export at the end of training "
        "replaces it whole and would delete it: choose a directory outside it (null: <checkpoint.dir>/hf)"
    )
    (issue,) = _issues(tmp_path, f"checkpoint.export_hf_dir={tmp_path}")
    assert f"'{tmp_path}' contains the run directory (logging.run_dir) {run};" in issue
    assert f"choose a directory outside {run} (null" in issue
    (issue,) = _issues(tmp_path, f"checkpoint.export_hf_dir={run / 'checkpoints'}")
    assert "is checkpoint.dir; the export at the end of training replaces it whole" in issue
    (issue,) = _issues(
        tmp_path, f"checkpoint.export_hf_dir={tmp_path / 'ck'}", f"checkpoint.dir={tmp_path / 'ck' / 'c'}"
    )
    assert f"contains checkpoint.dir {tmp_path / 'ck' / 'c'}" in issue
    ck = tmp_path / "ck"
    (issue,) = _issues(tmp_path, f"checkpoint.dir={ck}", f"logging.run_dir={ck / 'hf'}")  # the default collides
    assert issue.startswith(f"checkpoint.export_hf_dir: null (= {ck / 'hf'}) is the run directory (logging.run_dir)")
    (issue,) = _issues(tmp_path, f"checkpoint.export_hf_dir={run / 'checkpoints' / 'latest'}")
    assert "is or lies inside latest of checkpoint.dir" in issue
    unrelated = tmp_path / "mine"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("keep me")
    (issue,) = _issues(tmp_path, f"checkpoint.export_hf_dir={unrelated}")
    assert issue.endswith(
        "(no nemo_ac_export.json), so replacing it would delete them; empty it or choose another directory"
    )
    (unrelated / EXPORT_MARKER).write_text(marker_text(source="end of training", step=3))
    assert _issues(tmp_path, f"checkpoint.export_hf_dir={unrelated}") == []  # an earlier export: replaced
    assert _issues(tmp_path, "checkpoint.export_hf=false", f"checkpoint.export_hf_dir={run}") == []
