"""Where a Hugging Face export may go: never over what it reads, never over files no export wrote.

An export replaces its directory whole (written beside it as ``.<name>.partial``, then swapped in: a reader never
sees a half-written export). Replacing the wrong directory loses data, as measured before these checks:

- ``nemo-ac export RUN --out RUN`` deleted recipe.yaml, the metrics and every checkpoint of RUN, then failed with
  ``step_2/nemo_ac_checkpoint.json: missing``;
- an ``--out`` holding unrelated files was emptied silently (exit 0);
- a read-only ``--out`` ended in an ``OSError`` traceback about ``.hf.partial`` after the weights were loaded.

The rules, shared by ``nemo-ac export`` (``trainer.checkpoint.export``) and the end-of-training export's preflight
(``checkpoint.export_hf_dir``, ``nemo_ac.preflight``):

1. the target is not, does not contain and (for ``nemo-ac export``) does not lie inside a directory being read or
   kept: the run directory, the checkpoint directory, the checkpoint (``overlap``);
2. it is not a file nor a symbolic link, and, when it exists and is not empty, it is an earlier export: it holds
   ``nemo_ac_export.json``, the marker every export writes (``EXPORT_MARKER``). Anything else needs ``--force``
   (``replace_refusal``). A directory exported before the marker existed needs ``--force`` once;
3. its location can be written: checked by creating and removing a probe directory where the ``.partial`` goes
   (and inside an existing target, whose files the swap deletes) before anything is loaded (``write_blocker``).

Pure filesystem code: no torch, usable before any process group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXPORT_MARKER = "nemo_ac_export.json"
_MARKER_FORMAT = "nemo_ac_export"
_CHECKPOINT_ENTRY = re.compile(r"^(step_\d+|\.step_\d+\.partial|latest)$")  # checkpoint_files' layout


def export_dir_of(config: Any) -> Path:
    """Where the end-of-training export writes: ``checkpoint.export_hf_dir``, null = ``<checkpoint.dir>/hf``."""
    if config.export_hf_dir:
        return Path(config.export_hf_dir).expanduser()
    return Path(config.dir or ".").expanduser() / "hf"


def real(path: Path) -> Path:
    """``path`` absolute with every symbolic link and ``..`` resolved (its missing tail kept as written)."""
    return Path(os.path.realpath(Path(path).expanduser()))


@dataclass(frozen=True)
class Overlap:
    """``target`` *is*, *contains* or *lies inside* ``path`` (described as ``what``, e.g. "the run directory")."""

    relation: str
    what: str
    path: Path

    def describe(self, target: Path) -> str:
        """e.g. ``lies inside the run directory runs/x``; the path is left out where it is ``target`` as written."""
        named = "" if self.relation == "is" and str(self.path) == str(target) else f" {self.path}"
        return f"{self.relation} {self.what}{named}"


def overlap(target: Path, protected: Sequence[tuple[str, Path]], *, inside: bool = True) -> Overlap | None:
    """How ``target`` overlaps the first of ``protected`` ((description, path) pairs) it overlaps, or None: it *is*
    one, *contains* one, or (``inside``) *lies inside* one. Exact matches are reported first, then containment."""
    where = real(target)
    resolved = [(what, path, real(path)) for what, path in protected]
    for what, path, other in resolved:
        if where == other:
            return Overlap("is", what, path)
    for what, path, other in resolved:
        if other.is_relative_to(where):
            return Overlap("contains", what, path)
    if inside:
        for what, path, other in resolved:
            if where.is_relative_to(other):
                return Overlap("lies inside", what, path)
    return None


def checkpoint_entry(target: Path, checkpoint_dir: Path) -> str | None:
    """The checkpoint entry (``step_<N>``, ``.step_<N>.partial``, ``latest``) of ``checkpoint_dir`` that ``target``
    is or lies inside, or None: an export there would replace (or be pruned with) a checkpoint."""
    where, root = real(target), real(checkpoint_dir)
    if where == root or not where.is_relative_to(root):
        return None
    first = where.relative_to(root).parts[0]
    return first if _CHECKPOINT_ENTRY.match(first) else None


def is_export_dir(path: Path) -> bool:
    """True when ``path`` holds the marker an export writes (``EXPORT_MARKER``, a JSON object naming the format)."""
    try:
        data = json.loads((path / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == _MARKER_FORMAT


def replace_refusal(target: Path, *, force: bool = False) -> str | None:
    """Why ``target`` must not be replaced (rule 2 of the module docstring), or None. ``force`` allows a non-empty
    directory that holds no earlier export; never a file or a symbolic link."""
    if target.is_symlink():
        return (
            f"is a symbolic link to {real(target)}: the export would replace the link, not the directory it names; "
            "give the directory itself"
        )
    if not target.exists():
        return None
    if not target.is_dir():
        return "is a file, not a directory"
    if force or is_export_dir(target):
        return None
    try:
        entries = sorted(p.name for p in target.iterdir())
    except OSError as exc:
        return f"cannot be listed ({exc.strerror or exc})"
    if not entries:
        return None
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    return f"is not empty ({shown}) and holds no earlier nemo_ac export (no {EXPORT_MARKER}), so replacing it would delete them"


def _probe(directory: Path) -> str | None:
    """Create and remove a directory in ``directory``: None when that works, else why not."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".nemo_ac-write-probe-", dir=directory))
    except OSError as exc:
        return f"{directory} is not writable ({exc.strerror or exc})"
    return None


def write_blocker(target: Path) -> str | None:
    """Why the export cannot be written beside ``target`` and swapped in (rule 3), or None. Creates nothing that
    stays: the probes are removed, missing parents are not created."""
    parent = Path(os.path.abspath(target.expanduser())).parent
    existing = parent
    while not existing.exists():
        if existing.parent == existing:
            return f"has no existing parent directory ({parent})"
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be created: {existing} is a file"
    blocker = _probe(existing)
    if blocker is None and target.is_dir() and not target.is_symlink():
        blocker = _probe(target)  # the swap deletes the old export's files: they must be removable
    return blocker


def marker_text(*, source: str | None, step: int | None) -> str:
    """The content of ``EXPORT_MARKER``: what was exported, from where, when."""
    record = {"format": _MARKER_FORMAT, "version": 1, "source": source, "step": step, "created_unix": time.time()}
    return json.dumps(record, indent=1) + "\n"


def partial_of(target: Path) -> Path:
    return target.with_name(f".{target.name}.partial")


def swap_in(partial: Path, target: Path) -> None:
    """Replace ``target`` by the finished ``partial``: the previous export moves aside to ``.<name>.old`` and is
    deleted only after the rename; if the rename fails it is moved back, so ``target`` is never left missing."""
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    moved = False
    if target.exists():
        os.replace(target, old)
        moved = True
    try:
        os.replace(partial, target)
    except BaseException:
        if moved and not target.exists():
            os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
