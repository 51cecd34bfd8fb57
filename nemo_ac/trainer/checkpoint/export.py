"""``nemo-ac export RUN_OR_CHECKPOINT --out DIR``: any DCP checkpoint -> a Hugging Face model directory.

One process, CPU, no process group: the checkpoint's manifest holds the resolved recipe it was saved with, so the
model is rebuilt from it (``model.pretrained`` is not needed, nor read again for the architecture), its weights are
loaded from the DCP shards whatever world size saved them (DCP reshards to full tensors), and the directory is
written as the end-of-training export writes it (``hf_weights.export_model_dir``): config.json, safetensors in the
Hub layout, tokenizer / processor files and generation_config.json (``export_files``), published atomically.

``RUN_OR_CHECKPOINT`` may be a ``step_<N>`` directory, a checkpoint root (its newest complete step) or a run
directory (``<run>/checkpoints``, or the ``checkpoint.dir`` its ``recipe.yaml`` names).

Nothing it reads can be lost (``export_target`` has the rules and the failures they prevent): ``--out`` is refused,
before any weight is read, when it is, contains or lies inside the run directory, the checkpoint directory or the
checkpoint; when it is a non-empty directory that is no earlier export (``--force`` replaces it); and when its
location cannot be written. Every failure is an ``ExportError`` / ``CheckpointError`` with one line naming the path
and the fix (DCP's own ``CheckpointException`` included), and leaves a previous export at ``--out`` as it was.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from nemo_ac.config import recipe_from_container
from nemo_ac.config.schema import RecipeConfig
from nemo_ac.models import build_model, model_dtype
from nemo_ac.models.init import materialize_and_init
from nemo_ac.trainer.checkpoint import export_target as target
from nemo_ac.trainer.checkpoint import files
from nemo_ac.trainer.checkpoint.dcp import DCP_ERRORS, describe_dcp_error, structural_mismatches
from nemo_ac.trainer.checkpoint.files import CheckpointError
from nemo_ac.trainer.checkpoint.hf_weights import export_model_dir

_MAX_LISTED = 3


class ExportError(CheckpointError):
    """An ``--out`` that an export must not (or cannot) replace; the message names the path and the fix."""


@dataclass(frozen=True)
class Exported:
    checkpoint: Path
    step: int
    out: Path


def _roots(path: Path) -> list[Path]:
    """Checkpoint roots ``path`` may stand for: itself, ``<run>/checkpoints`` and the run's own checkpoint.dir."""
    roots = [path, path / "checkpoints"]
    recipe_file = path / "recipe.yaml"
    if recipe_file.is_file():
        try:
            named = (yaml.safe_load(recipe_file.read_text()) or {}).get("checkpoint", {}).get("dir")
        except yaml.YAMLError:
            named = None
        if named:
            roots.append(Path(named))
    return roots


def find_checkpoint(path: str | Path) -> Path:
    """The complete ``step_<N>`` directory ``path`` names (module docstring); ``CheckpointError`` otherwise."""
    p = Path(path).expanduser()
    if files.step_of(p) is not None or (p / files.MANIFEST).exists():
        reason = files.incomplete_reason(p)
        if reason is not None:
            raise CheckpointError(f"{p} {reason}: not a complete checkpoint")
        return p
    for root in _roots(p):
        choice = files.find_latest_complete(root)
        if choice.path is not None:
            return choice.path
    raise CheckpointError(
        f"{p}: no complete checkpoint here (looked for step_<N>/ with {files.MANIFEST} in "
        f"{', '.join(str(r) for r in _roots(p))}); give a run directory, a checkpoint.dir or a step_<N> directory"
    )


def recipe_of(checkpoint: Path) -> RecipeConfig:
    """The recipe a checkpoint was saved with (its manifest), its architecture as saved: ``model.pretrained`` is
    kept (the tokenizer comes from there) but not read again for the architecture."""
    manifest = files.read_manifest(checkpoint)
    data = copy.deepcopy(manifest.get("recipe") or {})
    if not isinstance(data.get("model"), dict):
        raise CheckpointError(f"{checkpoint / files.MANIFEST}: holds no recipe with a model section")
    pretrained = data["model"].pop("pretrained", None)
    recipe = recipe_from_container(data, source=str(checkpoint / files.MANIFEST))
    recipe.model.pretrained = pretrained
    return recipe


def protected_paths(given: Path, checkpoint: Path) -> list[tuple[str, Path]]:
    """What an export of ``checkpoint`` (found from the path ``given``) must never replace: the checkpoint, its
    checkpoint directory, and the run directory: ``given`` itself when it is neither of those, the checkpoint
    directory's parent when it holds the run's recipe.yaml or metrics.jsonl, and the ``logging.run_dir`` of the
    manifest's recipe when that directory exists."""
    root = checkpoint.parent
    candidates = [("the checkpoint being read", checkpoint), ("the checkpoint directory", root)]
    candidates.append(("the run directory", given))
    if any((root.parent / name).exists() for name in ("recipe.yaml", "metrics.jsonl")):
        candidates.append(("the run directory", root.parent))
    try:
        run_dir = (files.read_manifest(checkpoint).get("recipe") or {}).get("logging", {}).get("run_dir")
    except (CheckpointError, AttributeError):
        run_dir = None
    if run_dir and Path(run_dir).is_dir():
        candidates.append(("the run directory", Path(run_dir)))
    protected, seen = [], set()
    for what, path in candidates:
        if target.real(path) not in seen:
            seen.add(target.real(path))
            protected.append((what, path))
    return protected


def check_out(out: Path, *, given: Path, checkpoint: Path, force: bool) -> None:
    """``ExportError`` when ``out`` must not or cannot be replaced (module docstring); creates nothing."""
    found = target.overlap(out, protected_paths(given, checkpoint))
    if found is not None:
        why = (
            "an export must not write into what it reads"
            if found.relation == "lies inside"
            else "the export replaces --out whole and would delete it"
        )
        outside = "it" if found.relation == "is" else str(found.path)
        raise ExportError(f"--out {out} {found.describe(out)}; {why}: choose a directory outside {outside}")
    refusal = target.replace_refusal(out, force=force)
    if refusal is not None:
        replaceable = out.is_dir() and not out.is_symlink()
        fix = "choose a new or empty directory, or pass --force to replace it" if replaceable else "choose another"
        raise ExportError(f"--out {out} {refusal}; {fix}")
    blocker = target.write_blocker(out)
    if blocker is not None:
        raise ExportError(f"--out {out} cannot be written: {blocker}; choose a writable location")


def load_checkpoint_model(recipe: RecipeConfig, checkpoint: Path) -> torch.nn.Module:
    """The model of ``recipe`` on CPU with the weights of DCP checkpoint ``checkpoint`` (files verified first,
    then every tensor's name and shape against DCP's metadata)."""
    manifest = files.read_manifest(checkpoint)
    problems = files.verify_files(checkpoint, manifest, list(manifest["files"]), checksums=True)
    if problems:
        raise CheckpointError(f"checkpoint {checkpoint} is corrupt: " + "; ".join(problems))
    model = materialize_and_init(build_model(recipe.model), device="cpu", seed=recipe.train.seed)
    state = {"model": get_model_state_dict(model)}
    reader = dcp.FileSystemReader(str(checkpoint))
    try:
        metadata = reader.read_metadata()
    except DCP_ERRORS as exc:
        raise CheckpointError(f"{checkpoint / files.DCP_METADATA}: cannot be read ({describe_dcp_error(exc)})") from exc
    mismatches = structural_mismatches(state, metadata, sections=("model",))
    if mismatches:
        more = f" and {len(mismatches) - _MAX_LISTED} more" if len(mismatches) > _MAX_LISTED else ""
        raise CheckpointError(
            f"checkpoint {checkpoint}: its tensors do not fit the model of the recipe in its {files.MANIFEST}: "
            f"{'; '.join(mismatches[:_MAX_LISTED])}{more}; export the checkpoint with the manifest it was saved with"
        )
    try:
        with warnings.catch_warnings():  # one process on purpose: DCP's "assuming ... a single process" is expected
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=reader)
    except DCP_ERRORS as exc:
        raise CheckpointError(
            f"checkpoint {checkpoint}: its model does not load into the recipe's: {describe_dcp_error(exc)}"
        ) from exc
    set_model_state_dict(model, state["model"])
    return model.eval()


def export_checkpoint(path: str | Path, out: str | Path, *, dtype: str | None = None, force: bool = False) -> Exported:
    """Convert the checkpoint ``path`` names into an HF model directory at ``out`` (replaced whole, once the
    checks of ``check_out`` pass: they run before the recipe or a weight is read)."""
    given, out = Path(path).expanduser(), Path(out).expanduser()
    checkpoint = find_checkpoint(given)
    check_out(out, given=given, checkpoint=checkpoint, force=force)
    recipe = recipe_of(checkpoint)
    step = int(files.read_manifest(checkpoint)["step"])
    model = load_checkpoint_model(recipe, checkpoint)
    wanted = dtype or recipe.checkpoint.export_dtype
    try:
        export_model_dir(
            model,
            out,
            dtype=model_dtype(wanted) if wanted else None,
            recipe=recipe,
            source=str(target.real(checkpoint)),
            step=step,
        )
    except Exception as exc:  # a full disk (safetensors' SafetensorError), a failed rename: nothing was replaced
        raise ExportError(
            f"--out {out}: writing the export failed ({describe_dcp_error(exc)}); the previous content is unchanged"
        ) from exc
    return Exported(checkpoint=checkpoint, step=step, out=out)
