"""Per-step metrics on rank 0: the progress bar (or plain lines), JSONL in the run directory, the optional
TensorBoard / W&B backends, a final summary.

Every step record carries ``time`` (unix seconds) and ``time_iso`` (UTC), ``tokens_per_s`` (all ranks) and
``tokens_per_s_per_rank``, and ``mfu`` (model-FLOPs utilisation, ``nemo_ac.trainer.flops``) where the device's
peak is known. Fields are only ever added to the record, never renamed: readers of older files keep working.
"""

from __future__ import annotations

import datetime
import json
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from nemo_ac.trainer.metric_backends import MetricsBackend
from nemo_ac.trainer.progress import Progress, echo, use_bar


def peak_memory_gib(device: torch.device) -> float:
    """CUDA max allocated on GPU; the process RSS high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


@dataclass
class StepMetrics:
    step: int
    loss: float
    aux_loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_time_s: float
    tokens_per_s: float
    peak_memory_gib: float
    extra: dict[str, Any] = field(default_factory=dict)
    # Filled by MetricsLogger.log (rank 0): the record's wall clock, throughput per rank, model-FLOPs utilisation.
    time: float = 0.0
    tokens_per_s_per_rank: float = 0.0
    mfu: float | None = None

    def line(self, total_steps: int) -> str:
        text = (
            f"step {self.step:>4}/{total_steps} | loss {self.loss:.4f} | aux {self.aux_loss:.4f} | "
            f"grad_norm {self.grad_norm:.3f} | lr {self.lr:.2e} | {self.tokens_per_s:,.0f} tok/s "
            f"({self.tokens_per_s_per_rank:,.0f}/rank)" + (f" | mfu {self.mfu:.2%}" if self.mfu is not None else "")
        ) + f" | {self.step_time_s * 1000:.0f} ms | peak {self.peak_memory_gib:.2f} GiB"
        for key, value in self.extra.items():
            text += f" | {key} {value}"
        return text

    def short(self) -> list[str]:
        """The step's key metrics for the progress bar, most important first (a narrow terminal drops the tail)."""
        parts = [f"loss {self.loss:.4f}", f"{self.tokens_per_s:,.0f} tok/s"]
        if self.mfu is not None:
            parts.append(f"mfu {self.mfu:.1%}")
        return [*parts, f"gn {self.grad_norm:.2f}", f"lr {self.lr:.1e}", f"{self.peak_memory_gib:.2f} GiB"]

    def record(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        if data["mfu"] is None:
            del data["mfu"]
        if self.time:
            data["time_iso"] = datetime.datetime.fromtimestamp(self.time, datetime.UTC).isoformat(timespec="seconds")
        return data


@dataclass(frozen=True)
class Throughput:
    """What tokens/s per rank and MFU are computed from: the world size, the model's FLOPs per token
    (``nemo_ac.trainer.flops.model_flops_per_token``) and one device's peak FLOP/s (None: no MFU)."""

    world_size: int = 1
    flops_per_token: float = 0.0
    peak_flops: float | None = None
    peak_source: str = ""

    def fill(self, metrics: StepMetrics) -> None:
        metrics.tokens_per_s_per_rank = metrics.tokens_per_s / max(self.world_size, 1)
        if self.peak_flops and self.flops_per_token:
            metrics.mfu = self.flops_per_token * metrics.tokens_per_s_per_rank / self.peak_flops


def _is_fresh_start(record: Any) -> bool:
    return isinstance(record, dict) and record.get("event") == "start" and not record.get("resumed_from_step")


def _kept_lines(path: Path, resumed_from_step: int) -> str:
    """What stays of an existing ``path`` when a run starts: every earlier record (earlier runs in this run_dir are
    never truncated), except, on a resume from step k, the current timeline's records of steps > k (they are trained
    again) and a line cut short by a crash. The current timeline begins at the last fresh-start marker (a file
    written before markers existed is one timeline)."""
    if not path.exists():
        return ""
    parsed = []
    for line in path.read_text().splitlines():
        try:
            parsed.append((line, json.loads(line)))
        except ValueError:  # a line cut short by the crash that made this a resume
            continue
    begins = max((i for i, (_, record) in enumerate(parsed) if _is_fresh_start(record)), default=-1)
    kept = []
    for i, (line, record) in enumerate(parsed):
        step = record.get("step") if isinstance(record, dict) and "event" not in record else None
        if resumed_from_step and i > begins and isinstance(step, int) and step > resumed_from_step:
            continue
        kept.append(line + "\n")
    return "".join(kept)


def step_records(path: str | Path) -> list[dict[str, Any]]:
    """The per-step records of the latest run in ``path`` (a metrics.jsonl): the records after its last fresh-start
    marker (``{"event": "start", "resumed_from_step": 0}``), resumed attempts included, events left out."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if _is_fresh_start(record):
            records = []
        elif isinstance(record, dict) and "event" not in record and "step" in record:
            records.append(record)
    return records


class MetricsLogger:
    """Writes on rank 0 only; other ranks construct it with ``enabled=False``.

    metrics.jsonl is never truncated: every start appends a marker ``{"event": "start", "resumed_from_step": k, ...}``
    after what is there. ``resumed_from_step`` k > 0: a run resumed from a checkpoint of step k drops the current
    run's records of steps > k (they are trained again), so the run's records tell its whole curve once;
    ``step_records`` reads them back. k = 0 (a fresh start, also ``resume: auto`` with nothing to resume) keeps
    earlier runs' records before its marker.
    """

    def __init__(
        self,
        *,
        run_dir: str,
        total_steps: int,
        enabled: bool,
        jsonl: bool,
        progress_bar: str,
        log_every: int,
        stream: TextIO | None = None,
        resumed_from_step: int = 0,
        throughput: Throughput | None = None,
        backends: Sequence[MetricsBackend] = (),
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_every = max(log_every, 1)
        self.stream = stream or sys.stdout
        self.history: list[StepMetrics] = []
        self.started = time.perf_counter()
        self.throughput = throughput or Throughput()
        self.backends = list(backends) if enabled else []
        self.bar = enabled and use_bar(progress_bar, self.stream)
        self.progress: Progress | None = None
        self._progress_args = {"total_steps": total_steps, "initial_step": resumed_from_step, "bar": self.bar}
        self.jsonl_path: Path | None = None
        if enabled and jsonl:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.jsonl_path = Path(run_dir) / "metrics.jsonl"
            kept = _kept_lines(self.jsonl_path, resumed_from_step)
            self.jsonl_path.write_text(kept)
            self.event("start", resumed_from_step=resumed_from_step, total_steps=total_steps, time_unix=time.time())

    def event(self, name: str, **fields: Any) -> None:
        """Append ``{"event": name, **fields}`` to metrics.jsonl (rank 0; readers of step records skip events)."""
        if self.enabled and self.jsonl_path is not None:
            with self.jsonl_path.open("a") as handle:
                handle.write(json.dumps({"event": name, **fields}) + "\n")

    def start_progress(self) -> None:
        """Show the bar (or start the plain lines' clock) now: call right before the first step, after the start-up
        prints, so that the bar's elapsed time and ETA are the training's."""
        if self.enabled and self.progress is None:
            self.progress = Progress(**self._progress_args, log_every=self.log_every, stream=self.stream)

    def log(self, metrics: StepMetrics) -> None:
        self.history.append(metrics)
        if not self.enabled:
            return
        metrics.time = time.time()
        self.throughput.fill(metrics)
        record = metrics.record()
        if self.jsonl_path is not None:
            with self.jsonl_path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
        for backend in self.backends:
            backend.log(metrics.step, record)
        self.start_progress()
        assert self.progress is not None
        self.progress.update(metrics.step, short=metrics.short(), full=metrics.line(self.total_steps))

    def close(self) -> None:
        """End the progress display (the bar stays on screen) and close the backends; ``summary`` calls it."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        for backend in self.backends:
            backend.close()
        self.backends = []

    def summary(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        if not self.history:
            self.close()
            return {}
        times = sorted(m.step_time_s for m in self.history[1:]) or [self.history[0].step_time_s]
        result: dict[str, Any] = {
            "steps": len(self.history),
            "first_loss": self.history[0].loss,
            "final_loss": self.history[-1].loss,
            "median_step_time_s": times[len(times) // 2],
            "tokens": sum(m.tokens for m in self.history),
            "wall_time_s": time.perf_counter() - self.started,
            "peak_memory_gib": max(m.peak_memory_gib for m in self.history),
        }
        mfus = sorted(m.mfu for m in self.history[1:] if m.mfu is not None)
        if mfus:
            result["median_mfu"] = mfus[len(mfus) // 2]
            result["mfu_peak"] = self.throughput.peak_source
        result.update(extra or {})
        if self.enabled:
            for backend in self.backends:
                backend.summary(result)
            self.close()
            parts = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
            echo(f"summary | {parts}", file=self.stream)
            if self.jsonl_path is not None:
                (self.jsonl_path.parent / "summary.json").write_text(json.dumps(result, indent=2))
        return result
