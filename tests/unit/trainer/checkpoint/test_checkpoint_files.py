"""The on-disk checkpoint layout: only published directories count, partial ones are skipped with a reason,
``latest`` is replaced last, keep_last prunes, and the manifest catches truncated or corrupt files.

Pure filesystem (no process group): checkpoints are fabricated with the same files a DCP save leaves behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_ac.config.schema import CheckpointConfig
from nemo_ac.trainer.checkpoint import files
from nemo_ac.trainer.checkpoint.files import CheckpointError, check_checkpoint_paths


def fake_save(root: Path, step: int, *, payload: bytes = b"shard-bytes") -> Path:
    """What a finished DCP save leaves in the partial directory, published like Checkpointer.save does."""
    tmp = files.prepare_partial(root, step)
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / files.DCP_METADATA).write_bytes(b"dcp-metadata")
    digests = {p.name: files.file_digest(p) for p in tmp.iterdir()}
    manifest = {"format": files.FORMAT_VERSION, "step": step, "world_size": 1, "files": digests}
    return files.publish(tmp, step=step, manifest=manifest)


def test_publish_renames_the_finished_directory_and_then_points_latest_at_it(tmp_path):
    published = fake_save(tmp_path, 3)
    assert published == tmp_path / "step_3"
    assert files.incomplete_reason(published) is None
    assert not files.partial_dir(tmp_path, 3).exists()
    assert files.read_latest(tmp_path) == "step_3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3"]  # no temp pointer left behind
    assert files.read_manifest(published)["step"] == 3


def test_auto_resume_takes_the_newest_complete_and_warns_about_each_skipped_directory(tmp_path):
    fake_save(tmp_path, 2)
    fake_save(tmp_path, 4)
    crashed = files.prepare_partial(tmp_path, 6)  # killed during the save of step 6: shards, no metadata/manifest
    (crashed / "__0_0.distcp").write_bytes(b"half")
    copied = tmp_path / "step_8"  # a step dir without a manifest: a half-finished copy, not made by nemo_ac
    copied.mkdir()
    (copied / files.DCP_METADATA).write_bytes(b"x")
    choice = files.find_latest_complete(tmp_path)
    assert choice.path == tmp_path / "step_4"
    text = "\n".join(choice.warnings)
    assert ".step_6.partial: a save that never finished" in text
    assert f"step_8: has no {files.MANIFEST}" in text
    assert len(choice.warnings) == 2


def test_latest_naming_an_incomplete_directory_is_reported_and_not_used(tmp_path):
    fake_save(tmp_path, 2)
    (tmp_path / files.LATEST).write_text("step_9\n")
    choice = files.find_latest_complete(tmp_path)
    assert choice.path == tmp_path / "step_2"
    assert any("names 'step_9', which is not a complete checkpoint" in w for w in choice.warnings)


def test_a_crash_between_publish_and_pointer_update_loses_nothing(tmp_path):
    """The renamed directory is complete even if ``latest`` still names the previous one."""
    fake_save(tmp_path, 2)
    fake_save(tmp_path, 4)
    (tmp_path / files.LATEST).write_text("step_2\n")
    assert files.find_latest_complete(tmp_path).path == tmp_path / "step_4"


def test_empty_or_missing_directory_means_start_from_scratch(tmp_path):
    assert files.find_latest_complete(tmp_path / "nowhere") == files.ResumeChoice(None, [])
    assert files.find_latest_complete(tmp_path).path is None


def test_prune_keeps_the_newest_k_and_removes_stale_partials(tmp_path):
    for step in (2, 4, 6, 8):
        fake_save(tmp_path, step)
    files.prepare_partial(tmp_path, 5)  # an attempt that died saving step 5, since superseded
    files.prepare_partial(tmp_path, 10)  # newer than every complete checkpoint: not provably stale, kept
    deleted = files.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in deleted) == [".step_5.partial", "step_2", "step_4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_10.partial", "latest", "step_6", "step_8"]


def test_saving_a_step_again_replaces_it(tmp_path):
    fake_save(tmp_path, 4, payload=b"first")
    fake_save(tmp_path, 4, payload=b"second attempt")
    assert (tmp_path / "step_4" / "__0_0.distcp").read_bytes() == b"second attempt"
    assert (
        files.verify_files(
            tmp_path / "step_4", files.read_manifest(tmp_path / "step_4"), ["__0_0.distcp"], checksums=True
        )
        == []
    )


def test_truncated_and_corrupt_files_are_named_with_the_mismatch(tmp_path):
    path = fake_save(tmp_path, 2, payload=b"0123456789" * 100)
    manifest = files.read_manifest(path)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[500] ^= 0xFF
    shard.write_bytes(bytes(data))
    (problem,) = files.verify_files(path, manifest, ["__0_0.distcp"], checksums=True)
    assert str(shard) in problem and "sha256" in problem and "corrupt" in problem
    assert files.verify_files(path, manifest, ["__0_0.distcp"], checksums=False) == []  # same size: needs checksums
    shard.write_bytes(bytes(data[:300]))
    (problem,) = files.verify_files(path, manifest, ["__0_0.distcp"], checksums=False)
    assert f"{shard}: 300 bytes, the manifest says 1000" in problem
    shard.unlink()
    (problem,) = files.verify_files(path, manifest, ["__0_0.distcp"], checksums=False)
    assert f"{shard}: missing" in problem


def test_unreadable_manifest_is_a_checkpoint_error_naming_it(tmp_path):
    path = fake_save(tmp_path, 2)
    (path / files.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"{files.MANIFEST}: unreadable .*corrupt"):
        files.read_manifest(path)
    (path / files.MANIFEST).write_text('{"format": 99, "step": 2, "world_size": 1, "files": {}}')
    with pytest.raises(CheckpointError, match=r"format 99, this nemo_ac reads format 1"):
        files.read_manifest(path)
    (path / files.MANIFEST).write_text('{"format": 1, "step": "2", "world_size": 1, "files": {}}')
    with pytest.raises(CheckpointError, match=r"no integer 'step' / 'world_size'"):
        files.read_manifest(path)


def test_owned_files_split_the_work_without_overlap():
    names = [f"__{i}_0.distcp" for i in range(5)] + [".metadata"]
    shares = [files.owned_files(names, rank=r, world_size=4) for r in range(4)]
    assert sorted(n for share in shares for n in share) == sorted(names)


def test_resume_path_is_checked_before_any_process_group(tmp_path):
    fake_save(tmp_path, 2)
    assert check_checkpoint_paths(CheckpointConfig(resume=str(tmp_path / "step_2"))) == []
    assert check_checkpoint_paths(CheckpointConfig(resume="auto")) == []
    (root_issue,) = check_checkpoint_paths(CheckpointConfig(resume=str(tmp_path)))  # the root, not a step dir
    assert root_issue.key == "checkpoint.resume"
    assert "has no .metadata" in root_issue.message and "resume: auto" in root_issue.message
    (missing,) = check_checkpoint_paths(CheckpointConfig(resume=str(tmp_path / "step_7")))
    assert "does not exist" in missing.message


def test_saving_into_a_directory_with_another_runs_later_checkpoints_is_refused(tmp_path):
    fake_save(tmp_path, 2)
    fake_save(tmp_path, 4)
    files.prepare_partial(tmp_path, 6)  # partial saves are never a timeline
    (fresh,) = check_checkpoint_paths(CheckpointConfig(enabled=True, dir=str(tmp_path), resume="none"))
    assert fresh.key == "checkpoint.dir"
    assert "already holds step_2, step_4, past this run's start at step 0" in fresh.message
    assert "checkpoint.resume=auto" in fresh.message
    (branch,) = check_checkpoint_paths(
        CheckpointConfig(enabled=True, dir=str(tmp_path), resume=str(tmp_path / "step_2"))
    )
    assert "already holds step_4, past this run's start at step 2" in branch.message
    assert (
        check_checkpoint_paths(CheckpointConfig(enabled=True, dir=str(tmp_path), resume=str(tmp_path / "step_4"))) == []
    )
    assert check_checkpoint_paths(CheckpointConfig(enabled=True, dir=str(tmp_path), resume="auto")) == []
    assert check_checkpoint_paths(CheckpointConfig(enabled=False, dir=str(tmp_path), resume="none")) == []
