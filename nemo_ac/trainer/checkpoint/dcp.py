"""Distributed checkpoints with torch.distributed.checkpoint (DCP): save every N steps and at the end, resume.

What a checkpoint holds (one DCP state dict, so every part reshards with the world size):

- ``model`` / ``optim``: from ``get_state_dict`` (FSDP2 DTensor shards saved with their global shapes; keys are
  the model's FQNs with activation-checkpoint ``_checkpoint_wrapped_module`` and compile ``_orig_mod`` prefixes
  stripped, so layouts with and without AC / compile, at any world size, load each other).
- ``scheduler``, ``data`` (``SyntheticBatches.state_dict()``: the next step's index), ``trainer.step``.
- ``rng.rank<r>``: each rank's torch CPU (and CUDA) generator and Python ``random`` state. On a resume at another
  world size rank ``r`` takes rank ``r % saved_world_size``'s states (nothing in nemo_ac draws from them per rank
  today: init and data use their own seeded generators; dropout-style users would).

Where and how it is written (atomic publication, ``latest``, keep_last, partial/corrupt handling) is
``checkpoint_files``. Every decision that must be the same on all ranks (which checkpoint to resume, whether a
file is corrupt, whether publishing worked) is taken once and shared, so a failure raises on every rank instead
of leaving some of them waiting in a collective.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from nemo_ac.config.schema import CheckpointConfig
from nemo_ac.trainer.checkpoint import files
from nemo_ac.trainer.checkpoint.files import CheckpointError, check_checkpoint_paths
from nemo_ac.trainer.optim import builtin_lr, rebase_schedule, schedule_changes
from nemo_ac.trainer.progress import echo

__all__ = [
    "DCP_ERRORS",
    "CheckpointError",
    "CheckpointWarning",
    "Checkpointer",
    "TrainingState",
    "check_checkpoint_paths",
    "describe_dcp_error",
    "structural_mismatches",
]

_MAX_LISTED = 8


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (partial or incomplete), the ``latest`` pointer disagreed with the directory, or a
    resume changes the LR schedule."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingState:
    """Everything a resumed run needs besides the recipe. ``data`` is the batch source with a position."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: Stateful


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _from_main(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if _world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any) -> list[Any]:
    if _world_size() == 1:
        return [value]
    out: list[Any] = [None] * _world_size()
    dist.all_gather_object(out, value)
    return out


# DCP raises ``CheckpointException``, a BaseException: ``except Exception`` misses it and it escapes as a raw
# traceback (measured: ``nemo-ac export`` of a checkpoint of another model shape ended in ``CheckpointException``
# ... ``Size mismatch between saved torch.Size([262, 32]) and current ...``). Every DCP call catches these.
DCP_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


def describe_dcp_error(exc: BaseException) -> str:
    """One line for an error DCP raised: per failed rank, the inner error's type and message (a
    CheckpointException's own str is every rank's traceback); any other error: its type and message."""
    if isinstance(exc, CheckpointException):
        parts = []
        for rank, failure in sorted(exc.failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(inner).__name__}: {_one_line(inner)}")
        return "; ".join(parts)
    return f"{type(exc).__name__}: {_one_line(exc)}"


def _one_line(exc: BaseException) -> str:
    return " ".join(part.strip() for part in str(exc).splitlines() if part.strip())


def _raise_from_main(error: str | None, *, headline: str) -> None:
    """Raise rank 0's ``error`` (from work only rank 0 did) on every rank, so none waits in a later collective."""
    error = _from_main(error)
    if error:
        raise CheckpointError(f"{headline}: {error}")


def _raise_if_any(problems: list[str], *, headline: str) -> None:
    if problems:
        listed = "\n  - ".join(problems[:_MAX_LISTED])
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CheckpointError(f"{headline}:\n  - {listed}{more}")


# --------------------------------------------------------------------------------------------------------------
# state dicts


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _iter_tensors(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(DCP flattened key, tensor) of every tensor reachable through nested dicts (DCP joins keys with '.')."""
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            yield from _iter_tensors(value, name)
        elif isinstance(value, torch.Tensor):
            yield name, value


def structural_mismatches(
    state: dict[str, Any], metadata: Metadata, *, sections: tuple[str, ...] = ("model", "optim")
) -> list[str]:
    """Tensors of ``state``'s ``sections`` whose name, global shape or dtype differ from the checkpoint's, and
    checkpoint tensors of those sections the state lacks (empty: compatible)."""
    saved = metadata.state_dict_metadata
    problems = []
    wanted = {}
    for name, tensor in _iter_tensors({section: state[section] for section in sections}):
        wanted[name] = tensor
        entry = saved.get(name)
        if entry is None:
            problems.append(f"'{name}' is not in the checkpoint")
        elif not isinstance(entry, TensorStorageMetadata):
            problems.append(f"'{name}' is a tensor here but not in the checkpoint")
        elif tuple(entry.size) != tuple(tensor.shape):
            problems.append(f"'{name}': checkpoint shape {tuple(entry.size)}, model shape {tuple(tensor.shape)}")
        elif entry.properties.dtype != tensor.dtype:
            problems.append(f"'{name}': checkpoint dtype {entry.properties.dtype}, model dtype {tensor.dtype}")
    prefixes = tuple("optim.state." if section == "optim" else f"{section}." for section in sections)
    for name, entry in saved.items():
        tracked = isinstance(entry, TensorStorageMetadata) and name.startswith(prefixes)
        if tracked and name not in wanted:
            problems.append(f"'{name}' is in the checkpoint but not in this model/optimizer")
    return problems


def _config_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str) -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(_config_differences(a, b, f"{prefix}.{key}"))
        elif a != b:
            diffs.append(f"{prefix}.{key}: checkpoint {a!r}, recipe {b!r}")
    return diffs


# --------------------------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores a ``TrainingState`` under ``config.dir``; see the module docstring for what and how.

    ``recipe`` (the resolved recipe as a dict) goes into each manifest, so a checkpoint says how it was made and
    an incompatible resume can name the recipe keys that changed.
    """

    def __init__(
        self, *, config: CheckpointConfig, total_steps: int, recipe: dict[str, Any], device: torch.device
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Checkpointer needs an initialized process group (a world of one is fine)")
        self.config = config
        self.root = files.root_of(config)
        self.total_steps = total_steps
        self.recipe = recipe
        self.device = device
        self.options = StateDictOptions(full_state_dict=False, cpu_offload=False)

    # ---- saving ------------------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        if not self.config.enabled:
            return False
        every = self.config.every_n_steps
        return step == self.total_steps or (every > 0 and step % every == 0)

    def on_step_end(self, step: int, state: TrainingState) -> None:
        """``Trainer.fit(on_step_end=...)`` hook: save when the step is due (every N steps and the last one)."""
        if self.should_save(step):
            self.save(step, state)

    def _state_dict(self, state: TrainingState, step: int) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=self.options)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": state.scheduler.state_dict(),
            "data": state.data.state_dict(),
            "trainer": {"step": step},
            "rng": {f"rank{_rank()}": _rng_state(self.device)},
        }

    def save(self, step: int, state: TrainingState) -> Path:
        """Write ``step_<step>`` atomically: DCP into ``.step_<step>.partial``, checksums, manifest, rename, latest,
        prune. Returns the published directory. Every rank returns only after it is published."""
        started = time.perf_counter()
        data_position = state.data.state_dict().get("next_step", step)
        if data_position != step:
            raise CheckpointError(
                f"data position next_step={data_position} disagrees with the completed step {step}; refusing to save "
                "a checkpoint that would resume on different data"
            )
        tmp = files.partial_dir(self.root, step)
        error = None
        if _rank() == 0:
            try:
                files.prepare_partial(self.root, step)
            except OSError as exc:
                error = f"cannot create {tmp}: {exc}"
        _raise_from_main(error, headline=f"checkpoint save of step {step} failed")

        try:
            dcp.save(self._state_dict(state, step), storage_writer=dcp.FileSystemWriter(str(tmp)))
        except DCP_ERRORS as exc:  # never publish what failed
            raise CheckpointError(
                f"checkpoint save of step {step} into {tmp} failed: {describe_dcp_error(exc)}"
            ) from exc

        names = sorted(p.name for p in tmp.iterdir() if p.is_file())
        mine = files.owned_files(names, rank=_rank(), world_size=_world_size())
        digests: dict[str, Any] = {}
        for part in _gather({name: files.file_digest(tmp / name) for name in mine}):
            digests.update(part)
        error, published = None, None
        if _rank() == 0:
            manifest = {
                "format": files.FORMAT_VERSION,
                "step": step,
                "world_size": _world_size(),
                "torch": torch.__version__,
                "created_unix": time.time(),
                "recipe": self.recipe,
                "files": digests,
            }
            try:
                published = files.publish(tmp, step=step, manifest=manifest)
                files.prune(self.root, keep_last=self.config.keep_last)
            except OSError as exc:
                error = f"cannot publish {tmp} as step_{step}: {exc}"
        _raise_from_main(error, headline=f"checkpoint save of step {step} failed")
        if _rank() == 0:
            size = sum(d["size"] for d in digests.values())
            echo(f"checkpoint | saved {published} ({size / 2**20:.1f} MiB, {time.perf_counter() - started:.2f} s)")
        return files.step_dir(self.root, step)

    # ---- resuming ----------------------------------------------------------------------------------------

    def resolve_resume(self) -> Path | None:
        """The checkpoint to resume from, decided on rank 0 (ranks must never pick different ones)."""
        mode = self.config.resume
        if mode == "none":
            return None
        choice = None
        if _rank() == 0:
            if mode == "auto":
                found = files.find_latest_complete(self.root)
                for message in found.warnings:
                    warnings.warn(message, CheckpointWarning, stacklevel=2)
                choice = str(found.path) if found.path is not None else None
                if choice is None:
                    echo(f"checkpoint | no complete checkpoint under {self.root}; starting at step 0")
            else:
                choice = mode
        choice = _from_main(choice)
        return Path(choice) if choice is not None else None

    def restore(self, state: TrainingState) -> int:
        """Load the checkpoint ``checkpoint.resume`` selects into ``state``; the completed step (0: none)."""
        path = self.resolve_resume()
        return 0 if path is None else self.load(path, state)

    def _continue_schedule(self, manifest: dict[str, Any], state: TrainingState, step: int) -> None:
        """A checkpoint made with another LR schedule (train.steps, warmup_steps, lr, min_lr_ratio, scheduler): warn
        naming both values; with the built-in warmup + cosine, continue on this recipe's schedule evaluated at the
        restored step (``optim.rebase_schedule``). A custom ``train.scheduler`` keeps its restored state."""
        saved, current = manifest.get("recipe", {}).get("train", {}), self.recipe.get("train", {})
        changes = schedule_changes(saved, current)
        if not changes:
            return
        builtin = saved.get("scheduler") is None and current.get("scheduler") is None
        if builtin and isinstance(state.scheduler, torch.optim.lr_scheduler.LambdaLR):
            rebase_schedule(state.scheduler, state.optimizer, lr=current["lr"])
            how = (
                f"the LR continues on this recipe's schedule: step {step + 1} lr {builtin_lr(step, current):.3e} "
                f"(the checkpoint's schedule would give {builtin_lr(step, saved):.3e})"
            )
        else:
            how = (
                "train.scheduler is custom: its state is restored as saved, the recipe's schedule keys are not applied"
            )
        if _rank() == 0:
            warnings.warn(
                f"resuming step {step} with a changed LR schedule ({'; '.join(changes)}); {how}",
                CheckpointWarning,
                stacklevel=2,
            )

    def load(self, path: Path, state: TrainingState) -> int:
        """Verify ``path`` (every file against the manifest, in parallel over ranks), check that its tensors fit
        this model and optimizer, load it, and return its step."""
        started = time.perf_counter()
        reason = files.incomplete_reason(path)
        if reason is not None:
            raise CheckpointError(f"{path} {reason}: not a complete checkpoint")
        manifest = files.read_manifest(path)
        mine = files.owned_files(list(manifest["files"]), rank=_rank(), world_size=_world_size())
        problems = [
            p for part in _gather(files.verify_files(path, manifest, mine, checksums=self.config.verify)) for p in part
        ]
        _raise_if_any(problems, headline=f"checkpoint {path} is corrupt")

        reader = dcp.FileSystemReader(str(path))
        try:
            metadata = reader.read_metadata()
        except DCP_ERRORS as exc:  # a pickle that passed its checksum but does not unpickle: a torch mismatch
            raise CheckpointError(f"{path / files.DCP_METADATA}: cannot be read ({exc})") from exc
        step = int(manifest["step"])
        sd = self._state_dict(state, step)
        saved_world = int(manifest.get("world_size", 1))
        own, fallback = f"rank{_rank()}", f"rank{_rank() % saved_world}"
        rng_key = own if f"rng.{own}.cpu" in metadata.state_dict_metadata else fallback
        sd["rng"] = {rng_key: sd["rng"][own]}

        mismatches = structural_mismatches(sd, metadata)
        if mismatches:
            hints = _config_differences(
                manifest.get("recipe", {}).get("model", {}), self.recipe.get("model", {}), "model"
            )
            if hints:  # first: the listing below is cut after a few entries
                mismatches.insert(0, "recipe keys that differ from the checkpoint's: " + "; ".join(hints))
            _raise_if_any(
                mismatches,
                headline=f"checkpoint {path} does not fit this model/optimizer ({path / files.DCP_METADATA} vs recipe)",
            )
        try:
            dcp.load(sd, storage_reader=reader)
        except DCP_ERRORS as exc:
            raise CheckpointError(f"checkpoint {path} could not be loaded: {describe_dcp_error(exc)}") from exc

        loaded_step = int(sd["trainer"]["step"])
        if loaded_step != step or files.step_of(path) not in (None, step):
            raise CheckpointError(
                f"{path}: holds step {loaded_step}, its manifest says {step}; the checkpoint is corrupt"
            )
        set_state_dict(
            state.model,
            state.optimizer,
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
            options=self.options,
        )
        state.scheduler.load_state_dict(sd["scheduler"])
        self._continue_schedule(manifest, state, step)
        state.data.load_state_dict(sd["data"])
        _set_rng_state(sd["rng"][rng_key], self.device)
        if _rank() == 0:
            note = (
                f" (saved at world size {saved_world}, resharded to {_world_size()})"
                if saved_world != _world_size()
                else ""
            )
            echo(f"checkpoint | resumed from {path} at step {step}{note} ({time.perf_counter() - started:.2f} s)")
        return step
