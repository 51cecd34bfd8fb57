"""The one validation path: every check a run makes before its process group, shared by ``nemo-ac validate``, the
torchrun entry (``nemo_ac.train``) and ``nemo-ac train``.

``preflight(recipe_path, overrides, world_size=..., check_env=...)`` runs, in order, collecting every problem into
one ``ConfigError`` (each naming its key and the fix):

1. load: YAML + overrides, the typed schema, and ``model.pretrained``'s config.json filling the architecture
   (``config.load`` / ``config.pretrained``; this is where an unreadable or unavailable config.json fails);
2. the cross-field rules (``config.validate.RULES``) at ``world_size``;
3. the pretrained checkpoint: its config.json fits the recipe, the family has an HF mapping for a load or an export
   (``config.pretrained.check_pretrained``), and every safetensors header of a local directory reads: 8-byte
   length, JSON, tensor spans that cover the file (``config.pretrained_files``; kilobytes per file, no tensor);
4. data: each local ``data.path`` file exists, is UTF-8, parses (JSONL: every line of its head, named by line
   number) and holds the columns and usable first rows the recipe names (``config.data_files``; a Hub id is not
   checked: no network here); for ``kind: text``, ``data.chat_template`` exists, a chat recipe's local tokenizer has
   a chat template, and the tokenized corpus's cache entry is there or ``data.cache_dir`` can be written
   (``config.corpus_key``);
5. paths: ``checkpoint.resume`` names a complete checkpoint, ``checkpoint.dir`` holds no other run's later steps
   (``trainer.checkpoint.files.check_checkpoint_paths``), the end-of-training HF export can replace its directory
   without deleting the run, a checkpoint or unrelated files (``check_export_dir``), and the directories the run
   writes (run dir, checkpoints, HF export) can be created;
6. with ``check_env`` (always for a run, ``--check-env`` for validate): the optional extras, CUDA, DeepEP and the
   torch.compile backend the recipe names (``config.environment``); and every tensor of a local
   ``model.pretrained``'s headers against the model built on the meta device: missing, unexpected, shape, dtype
   (``trainer.checkpoint.hf_weights.check_pretrained_tensors``, the loader's own plan);
7. the parallel plan, always: the model built on the meta device and the plan the run would apply, decided by the
   same code ``nemo-ac validate --plan`` prints (``trainer.build.plan_recipe``). The plan is the one judge of the
   layout rules that need the model (compile_outer / fullgraph over nested FSDP units or modules Dynamo will not
   trace, AC outside fully_shard under compile_outer, a mixer kind without a CP op); each becomes an issue naming
   its key and the fix. ``Preflight.plan`` keeps it for ``--plan``.

A Hub id (``data.path`` or ``model.pretrained``) is not read here: no network call. Nothing here starts a process
group; steps 6 and 7 import torch and build a model, on the meta device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nemo_ac.config import ConfigError, ConfigIssue, RecipeConfig, check_environment, load_recipe, validate_recipe
from nemo_ac.config.corpus_key import check_text_corpus
from nemo_ac.config.data_files import check_data_files
from nemo_ac.config.layout import ParallelLayout
from nemo_ac.config.pretrained import check_pretrained
from nemo_ac.config.pretrained_files import check_pretrained_files
from nemo_ac.trainer.checkpoint.export_target import checkpoint_entry, export_dir_of, overlap, replace_refusal
from nemo_ac.trainer.checkpoint.files import check_checkpoint_paths

if TYPE_CHECKING:
    from nemo_ac.distributed.plan import ParallelPlan


@dataclass
class Preflight:
    """A recipe that passed every check, its layout, and the notes loading made (print them once, on rank 0)."""

    recipe: RecipeConfig
    layout: ParallelLayout
    notes: list[str] = field(default_factory=list)
    plan: ParallelPlan | None = None  # the plan the run would apply on this machine's device (step 7)


def _unwritable(path: Path) -> str | None:
    """Why ``path`` (a directory the run will create or write into) cannot be written, or None."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return "has no existing parent directory"
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot be created: {probe} is a file"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"cannot be written: {probe} is not writable by this user"
    return None


def check_writable_dirs(recipe: RecipeConfig) -> list[ConfigIssue]:
    """The directories this run writes: the run dir always, checkpoints when saving, the HF export when exporting."""
    targets = {"logging.run_dir": recipe.logging.run_dir}
    if recipe.checkpoint.enabled and recipe.checkpoint.dir:
        targets["checkpoint.dir"] = recipe.checkpoint.dir
    if recipe.checkpoint.export_hf:
        targets["checkpoint.export_hf_dir"] = str(export_dir_of(recipe.checkpoint))
    issues = []
    for key, value in targets.items():
        reason = _unwritable(Path(value).expanduser())
        if reason is not None:
            issues.append(ConfigIssue(key, f"'{value}' {reason}; point {key} at a writable location"))
    return issues


def check_export_dir(recipe: RecipeConfig) -> list[ConfigIssue]:
    """With ``checkpoint.export_hf``: the export at the end of training replaces ``checkpoint.export_hf_dir`` (null:
    ``<checkpoint.dir>/hf``) whole, so it must not be or contain the run directory or ``checkpoint.dir`` (the same
    mistake as ``nemo-ac export RUN --out RUN``, which deleted the run's recipe, metrics and checkpoints), must not
    be a checkpoint (``step_<N>``, ``latest``, the ``checkpoint.resume`` one), and must be new, empty or an earlier
    export (``trainer.checkpoint.export_target``). Found here, hours before the export would run."""
    config = recipe.checkpoint
    if not config.export_hf:
        return []
    out = export_dir_of(config)
    shown = f"'{config.export_hf_dir}'" if config.export_hf_dir else f"null (= {out})"
    protected = [("the run directory (logging.run_dir)", Path(recipe.logging.run_dir))]
    if config.dir:
        protected.append(("checkpoint.dir", Path(config.dir)))
    found = overlap(out, protected, inside=False)
    if found is not None:
        why = f"{found.describe(out)}; the export at the end of training replaces it whole and would delete it"
        fix = f"choose a directory outside {'it' if found.relation == 'is' else found.path} (null: <checkpoint.dir>/hf)"
        return [ConfigIssue("checkpoint.export_hf_dir", f"{shown} {why}: {fix}")]
    if config.resume not in ("none", "auto"):
        found = overlap(out, [("the checkpoint checkpoint.resume names", Path(config.resume))])
        if found is not None:
            why = f"{found.describe(out)}; the export must not replace or write into it"
            return [ConfigIssue("checkpoint.export_hf_dir", f"{shown} {why}: choose a directory outside it")]
    entry = checkpoint_entry(out, Path(config.dir)) if config.dir else None
    if entry is not None:
        return [
            ConfigIssue(
                "checkpoint.export_hf_dir",
                f"{shown} is or lies inside {entry} of checkpoint.dir, where checkpoints are saved, pruned and "
                "pointed to: choose another name (null: <checkpoint.dir>/hf)",
            )
        ]
    refusal = replace_refusal(out)
    if refusal is not None:
        fix = "empty it or choose another directory" if out.is_dir() and not out.is_symlink() else "choose another"
        return [ConfigIssue("checkpoint.export_hf_dir", f"{shown} {refusal}; {fix}")]
    return []


def check_compile_backend(recipe: RecipeConfig) -> list[ConfigIssue]:
    """A ``compile.backend`` this torch does not register (imports torch.compiler; environment check)."""
    if not recipe.compile.enabled:
        return []
    import torch.compiler

    try:
        known = set(torch.compiler.list_backends(exclude_tags=()))
    except Exception:  # listing is best effort; parallelize checks again
        return []
    if recipe.compile.backend in known:
        return []
    return [
        ConfigIssue(
            "compile.backend",
            f"{recipe.compile.backend!r} is not a registered torch.compile backend; use one of {sorted(known)}",
        )
    ]


def preflight(
    recipe_path: str,
    overrides: Sequence[str] = (),
    *,
    world_size: int,
    check_env: bool,
    cuda_available: bool | None = None,
) -> Preflight:
    """Every check before the process group (module docstring); ``ConfigError`` listing all problems found."""
    notes: list[str] = []
    recipe = load_recipe(recipe_path, overrides, notes=notes)
    layout = validate_recipe(recipe, world_size=world_size, source=recipe_path)
    issues = check_pretrained(recipe)
    if not issues:  # config.json fits: its files next
        issues = check_pretrained_files(recipe)
    weights_readable = not issues
    data_issues = check_data_files(recipe, notes)
    issues += data_issues if data_issues else check_text_corpus(recipe)
    issues += check_checkpoint_paths(recipe.checkpoint)
    issues += check_export_dir(recipe)
    issues += check_writable_dirs(recipe)
    if check_env:
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        issues += check_environment(recipe, cuda_available=cuda_available)
        issues += check_compile_backend(recipe)
        if weights_readable and recipe.model.pretrained:
            from nemo_ac.trainer.checkpoint.hf_weights import check_pretrained_tensors  # torch and the model, on meta

            issues += check_pretrained_tensors(recipe)
    plan, plan_issues = check_plan(recipe, layout)
    issues += plan_issues
    if issues:
        raise ConfigError(issues, source=recipe_path)
    return Preflight(recipe=recipe, layout=layout, notes=notes, plan=plan)


def check_plan(recipe: RecipeConfig, layout: ParallelLayout) -> tuple[ParallelPlan | None, list[ConfigIssue]]:
    """Step 7: the plan for this machine's device (``dist.device: auto`` resolved as the run resolves it), or the
    layout rules it refuses (imports torch, builds the model on meta)."""
    from nemo_ac.runtime import resolve_device_type
    from nemo_ac.trainer.build import plan_recipe

    try:
        return plan_recipe(recipe, layout, device_type=resolve_device_type(recipe.dist)), []
    except ConfigError as exc:
        return None, exc.issues
