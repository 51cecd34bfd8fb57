"""The on-disk layout of checkpoints: atomic publication, the ``latest`` pointer, discovery, pruning, checksums.

Layout under ``checkpoint.dir``::

    step_<N>/              a complete checkpoint: DCP shards (__<rank>_<i>.distcp), DCP's .metadata, and
                           nemo_ac_checkpoint.json (the manifest: step, world size, recipe, size + sha256 per file)
    .step_<N>.partial/     a save in progress, or one a crash interrupted: never loaded
    latest                 names the newest step_<N>; replaced atomically after that directory is published

A checkpoint becomes visible as ``step_<N>`` only by a rename of its finished temporary directory, after every
shard, DCP's metadata and the manifest are written and fsync-ed. So a ``step_<N>`` without its manifest was not
made by this code (a half-finished copy, a non-atomic filesystem) and is skipped with a warning, like a
``.partial`` directory. A complete-looking checkpoint whose files fail their sizes/checksums is corrupt: that is an
error, never a silent fallback to an older checkpoint.

Pure filesystem code: no torch here (``check_checkpoint_paths`` runs in the preflight, before any process group);
``checkpoint.py`` decides which rank calls what.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_ac.config.errors import ConfigIssue
from nemo_ac.config.schema import CheckpointConfig

MANIFEST = "nemo_ac_checkpoint.json"
DCP_METADATA = ".metadata"
LATEST = "latest"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_PARTIAL_RE = re.compile(r"^\.step_(\d+)\.partial$")
_CHUNK = 8 * 2**20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: corrupt, incompatible with the recipe, or not a checkpoint at all.

    The message names the file and the mismatch. Raised on every rank (the ranks agree before raising), so a
    bad checkpoint ends the job instead of hanging it in a collective.
    """


def root_of(config: Any) -> Path:
    """``checkpoint.dir`` as a path; ``load_recipe`` resolves its null default to ``<logging.run_dir>/checkpoints``."""
    if not config.dir:
        raise ValueError(
            "checkpoint.dir is unset: load the recipe with nemo_ac.config.load_recipe (or call "
            "nemo_ac.config.load.resolve_paths), which resolves it to <logging.run_dir>/checkpoints"
        )
    return Path(config.dir)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".step_{step}.partial"


def step_of(path: Path) -> int | None:
    """N for a directory named ``step_<N>``, else None."""
    match = _STEP_RE.match(path.name)
    return int(match.group(1)) if match else None


def incomplete_reason(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is one (files are checked later, on load)."""
    try:
        if not path.is_dir():
            return "does not exist" if not path.exists() else "is not a directory"
    except (OSError, ValueError) as exc:  # unreadable mount, a name with a NUL byte
        return f"cannot be accessed ({exc})"
    missing = [name for name in (DCP_METADATA, MANIFEST) if not (path / name).is_file()]
    if missing:
        return f"has no {' and no '.join(missing)} (an interrupted or partial copy)"
    return None


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint ``resume: auto`` picked (None: start from scratch) and what was skipped on the way."""

    path: Path | None
    warnings: list[str]


def complete_checkpoints(root: Path) -> tuple[dict[int, Path], list[str]]:
    """Every complete ``step_<N>`` under ``root`` by N, and a warning for each partial or incomplete directory."""
    warnings: list[str] = []
    complete: dict[int, Path] = {}
    if not root.is_dir():
        return complete, warnings
    for entry in sorted(root.iterdir()):
        if _PARTIAL_RE.match(entry.name):
            warnings.append(f"skipping {entry}: a save that never finished (crash or kill during the save)")
            continue
        step = step_of(entry)
        if step is None:
            continue
        reason = incomplete_reason(entry)
        if reason is None:
            complete[step] = entry
        else:
            warnings.append(f"skipping {entry}: {reason}")
    return complete, warnings


def find_latest_complete(root: Path) -> ResumeChoice:
    """The newest complete ``step_<N>`` under ``root``; every partial or incomplete directory becomes a warning.

    The ``latest`` pointer is cross-checked: it lags only when a crash hit between publishing a directory and
    updating the pointer (that directory is complete, so it is used), and names an incomplete directory only if
    someone edited the tree by hand.
    """
    complete, warnings = complete_checkpoints(root)
    pointed = read_latest(root)
    if pointed is not None and step_of(root / pointed) not in complete:
        warnings.append(f"{root / LATEST} names '{pointed}', which is not a complete checkpoint; ignoring it")
    if not complete:
        return ResumeChoice(None, warnings)
    return ResumeChoice(complete[max(complete)], warnings)


def read_latest(root: Path) -> str | None:
    try:
        text = (root / LATEST).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text or None


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (directory entries are data too); best effort where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prepare_partial(root: Path, step: int) -> Path:
    """An empty ``.step_<N>.partial`` (a leftover of a crashed save of the same step is removed first)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = partial_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def file_digest(path: Path) -> dict[str, Any]:
    """Size and sha256 of one file (read in chunks: shards can be large)."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def owned_files(names: list[str], *, rank: int, world_size: int) -> list[str]:
    """This rank's share of ``names`` for hashing/verifying in parallel (round robin over the sorted names)."""
    return [name for i, name in enumerate(sorted(names)) if i % world_size == rank]


def publish(tmp: Path, *, step: int, manifest: dict[str, Any]) -> Path:
    """Write the manifest into the finished ``tmp``, rename it to ``step_<N>``, then point ``latest`` at it."""
    root = tmp.parent
    manifest_path = tmp / MANIFEST
    with manifest_path.open("w") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    final = step_dir(root, step)
    if final.exists():  # re-saving a step after resuming from an earlier checkpoint: the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    return final


def prune(root: Path, *, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and leftover partial saves older than the
    newest complete one (a save runs synchronously, so none of those is in progress). Returns what was deleted."""
    steps = sorted((step_of(p), p) for p in root.iterdir() if step_of(p) is not None and incomplete_reason(p) is None)
    if not steps:
        return []
    newest = steps[-1][0]
    doomed = [path for _, path in steps[:-keep_last]] if keep_last > 0 else []
    for entry in root.iterdir():
        match = _PARTIAL_RE.match(entry.name)
        if match and int(match.group(1)) <= newest:
            doomed.append(entry)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``; an unreadable one is a CheckpointError naming the file."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{manifest_path}: missing; {path} is not a complete nemo_ac checkpoint") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable ({exc}); the checkpoint is corrupt") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_path}: not a nemo_ac manifest (no 'files' table); the checkpoint is corrupt")
    if not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("world_size"), int):
        raise CheckpointError(f"{manifest_path}: no integer 'step' / 'world_size'; the checkpoint is corrupt")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path}: format {manifest.get('format')!r}, this nemo_ac reads format {FORMAT_VERSION}"
        )
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], names: list[str], *, checksums: bool) -> list[str]:
    """Problems with the given files of checkpoint ``path`` against its manifest (empty: all intact)."""
    problems = []
    for name in names:
        expected = manifest["files"][name]
        file_path = path / name
        if not file_path.is_file():
            problems.append(f"{file_path}: missing (the manifest lists it)")
            continue
        size = file_path.stat().st_size
        if size != expected["size"]:
            problems.append(f"{file_path}: {size} bytes, the manifest says {expected['size']} (truncated or replaced)")
            continue
        if checksums:
            actual = file_digest(file_path)["sha256"]
            if actual != expected["sha256"]:
                problems.append(
                    f"{file_path}: sha256 {actual[:16]}... does not match the manifest's {expected['sha256'][:16]}... "
                    "(the file is corrupt)"
                )
    return problems


def check_checkpoint_paths(config: CheckpointConfig) -> list[ConfigIssue]:
    """Checkpoint paths that cannot work, found before any process group starts (so torchrun does not restart a
    job that can never run): a ``resume`` path that is not a complete checkpoint, and, when this run saves, a
    ``checkpoint.dir`` that already holds checkpoints past this run's start (another run's timeline: the two would
    interleave, ``keep_last`` could delete the new ones first, and a later ``resume: auto`` would pick the old)."""
    start = 0
    if config.resume not in ("none", "auto"):
        reason = incomplete_reason(Path(config.resume))
        if reason is not None:
            return [
                ConfigIssue(
                    "checkpoint.resume",
                    f"'{config.resume}' {reason}; give a complete step_<N> directory (one with {DCP_METADATA} "
                    f"and {MANIFEST}), or resume: auto to take the newest complete one under checkpoint.dir",
                )
            ]
        start = step_of(Path(config.resume)) or 0
    if not config.enabled or config.resume == "auto":
        return []
    complete, _ = complete_checkpoints(root_of(config))
    ahead = sorted(step for step in complete if step > start)
    if not ahead:
        return []
    names = ", ".join(f"step_{step}" for step in ahead)
    return [
        ConfigIssue(
            "checkpoint.dir",
            f"'{config.dir}' already holds {names}, past this run's start at step {start} (resume: "
            f"{config.resume}); its saves would mix with them. Use checkpoint.resume=auto to continue them, or a "
            "new checkpoint.dir",
        )
    ]
