"""Metrics backends beside metrics.jsonl (rank 0): TensorBoard event files and a Weights & Biases run.

Both get the same numeric fields as the JSONL record of each step (non-numeric fields, e.g. recompile reasons,
stay in the JSONL), keyed by the optimizer step. Their packages are optional extras, imported only when a recipe
turns a backend on; ``nemo_ac.config.environment`` rejects a recipe that asks for one whose package is missing,
before any process group, so these imports do not fail mid-run.
"""

from __future__ import annotations

from numbers import Real
from pathlib import Path
from typing import Any, Protocol

from nemo_ac.config.schema import LoggingConfig

# JSONL fields that are not curves: the step is the x axis, time is the wall clock of the record.
_NOT_SCALARS = {"step", "time", "time_iso"}


class MetricsBackend(Protocol):
    def log(self, step: int, record: dict[str, Any]) -> None: ...

    def summary(self, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a record (bools and None left out)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in _NOT_SCALARS and isinstance(value, Real) and not isinstance(value, bool)
    }


class TensorBoardBackend:
    """``logging.tensorboard: true``: event files in ``run_dir/tensorboard`` (``tensorboard --logdir RUN_DIR``)."""

    def __init__(self, run_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (nemo_ac[tensorboard])

        self.log_dir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, record: dict[str, Any]) -> None:
        wall = record.get("time")
        for key, value in scalars(record).items():
            self.writer.add_scalar(f"train/{key}", value, global_step=step, walltime=wall)
        self.writer.flush()

    def summary(self, summary: dict[str, Any]) -> None:
        text = "\n".join(f"    {key}: {value}" for key, value in summary.items())  # markdown code block
        self.writer.add_text("summary", text)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """``logging.wandb.mode: offline | online``: a W&B run in ``run_dir/wandb`` whose config is the resolved recipe."""

    def __init__(self, config: LoggingConfig, *, run_name: str, recipe: dict[str, Any], resumed_from_step: int) -> None:
        import wandb  # nemo_ac[wandb]

        Path(config.run_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.wandb.project,
            name=config.wandb.name or run_name,
            mode=config.wandb.mode,
            dir=config.run_dir,
            config=recipe,
            # A resume logs steps > k again; W&B rejects steps below its last one, so keep the history monotone
            # by starting a new run (its config says which step it resumed from).
            notes=f"resumed from step {resumed_from_step}" if resumed_from_step else None,
        )

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.run.log({f"train/{key}": value for key, value in scalars(record).items()}, step=step)

    def summary(self, summary: dict[str, Any]) -> None:
        for key, value in summary.items():
            if isinstance(value, (Real, str)):
                self.run.summary[key] = value

    def close(self) -> None:
        self.run.finish()


def build_backends(
    config: LoggingConfig, *, run_name: str, recipe: dict[str, Any] | None, resumed_from_step: int
) -> list[MetricsBackend]:
    """The backends ``config`` turns on (call on rank 0 only)."""
    backends: list[MetricsBackend] = []
    if config.tensorboard:
        backends.append(TensorBoardBackend(config.run_dir))
    if config.wandb.mode != "disabled":
        backends.append(
            WandbBackend(config, run_name=run_name, recipe=recipe or {}, resumed_from_step=resumed_from_step)
        )
    return backends
