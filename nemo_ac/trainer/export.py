"""``nemo-ac export RUN_OR_CHECKPOINT --out DIR``: any DCP checkpoint -> a Hugging Face model directory.

One process, CPU, no process group: the checkpoint's manifest holds the resolved recipe it was saved with, so the
model is rebuilt from it (``model.pretrained`` is not needed, nor read again for the architecture), its weights are
loaded from the DCP shards whatever world size saved them (DCP reshards to full tensors), and the directory is
written as the end-of-training export writes it (``hf_weights.export_model_dir``): config.json, safetensors in the
Hub layout, tokenizer / processor files and generation_config.json (``export_files``), published atomically.

``RUN_OR_CHECKPOINT`` may be a ``step_<N>`` directory, a checkpoint root (its newest complete step) or a run
directory (``<run>/checkpoints``, or the ``checkpoint.dir`` its ``recipe.yaml`` names).
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
from nemo_ac.trainer import checkpoint_files as files
from nemo_ac.trainer.checkpoint_files import CheckpointError
from nemo_ac.trainer.hf_weights import export_model_dir


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


def load_checkpoint_model(recipe: RecipeConfig, checkpoint: Path) -> torch.nn.Module:
    """The model of ``recipe`` on CPU with the weights of DCP checkpoint ``checkpoint`` (files verified first)."""
    manifest = files.read_manifest(checkpoint)
    problems = files.verify_files(checkpoint, manifest, list(manifest["files"]), checksums=True)
    if problems:
        raise CheckpointError(f"checkpoint {checkpoint} is corrupt: " + "; ".join(problems))
    model = materialize_and_init(build_model(recipe.model), device="cpu", seed=recipe.train.seed)
    state = {"model": get_model_state_dict(model)}
    try:
        with warnings.catch_warnings():  # one process on purpose: DCP's "assuming ... a single process" is expected
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(checkpoint)))
    except Exception as exc:
        raise CheckpointError(f"checkpoint {checkpoint}: its model does not load into the recipe's: {exc}") from exc
    set_model_state_dict(model, state["model"])
    return model.eval()


def export_checkpoint(path: str | Path, out: str | Path, *, dtype: str | None = None) -> Exported:
    """Convert the checkpoint ``path`` names into an HF model directory at ``out`` (replaced whole)."""
    checkpoint = find_checkpoint(path)
    recipe = recipe_of(checkpoint)
    model = load_checkpoint_model(recipe, checkpoint)
    wanted = dtype or recipe.checkpoint.export_dtype
    export_model_dir(model, Path(out), dtype=model_dtype(wanted) if wanted else None, recipe=recipe)
    return Exported(checkpoint=checkpoint, step=int(files.read_manifest(checkpoint)["step"]), out=Path(out))
