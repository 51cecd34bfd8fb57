"""Launch real multi-process runs with torchrun (gloo on CPU) and read back their metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_ac.trainer.metrics import step_records

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


@dataclass
class RunResult:
    returncode: int
    output: str
    run_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    def check(self) -> RunResult:
        assert self.returncode == 0, f"run failed ({self.returncode}):\n{self.output[-6000:]}"
        return self


def torchrun_command(nproc: int, module_args: list[str], *, max_restarts: int = 0) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if max_restarts:
        command.append(f"--max-restarts={max_restarts}")
    return command + module_args


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_recipe(
    recipe: str | Path,
    *,
    nproc: int,
    run_dir: Path,
    overrides: list[str] = (),
    env: dict[str, str] | None = None,
    max_restarts: int = 0,
    timeout: int = 600,
) -> RunResult:
    """Train ``recipe`` on ``nproc`` gloo processes; metrics come from the run's JSONL."""
    recipe_path = RECIPES / recipe if not Path(recipe).is_absolute() else Path(recipe)
    args = [
        "-m",
        "nemo_ac.train",
        str(recipe_path),
        f"logging.run_dir={run_dir}",
        "logging.progress_bar=never",
        *overrides,
    ]
    proc = subprocess.run(
        torchrun_command(nproc, args, max_restarts=max_restarts),
        env=child_env(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    result = RunResult(returncode=proc.returncode, output=proc.stdout + proc.stderr, run_dir=run_dir)
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.exists():
        result.metrics = step_records(metrics_file)  # the latest run's step records (start/stop events left out)
    summary_file = run_dir / "summary.json"
    if summary_file.exists():
        result.summary = json.loads(summary_file.read_text())
    return result


def run_script(
    script: Path, *, nproc: int, args: list[str] = (), env: dict[str, str] | None = None, timeout: int = 600
):
    """Run a test worker script under torchrun; returns the CompletedProcess."""
    return subprocess.run(
        torchrun_command(nproc, [str(script), *args]),
        env=child_env(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_close_rel(actual: list[float], expected: list[float], *, rel: float) -> None:
    assert len(actual) == len(expected), (actual, expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rel * max(abs(e), 1e-12), f"step {i + 1}: {a!r} vs {e!r} (rel tol {rel})"


def checkpointing(ckpt_dir: Path, *, every: int, resume: str = "auto") -> list[str]:
    """The overrides that save a DCP checkpoint every ``every`` steps under ``ckpt_dir`` and resume per ``resume``."""
    return [
        "checkpoint.enabled=true",
        f"checkpoint.dir={ckpt_dir}",
        f"checkpoint.every_n_steps={every}",
        f"checkpoint.resume={resume}",
    ]


def records(run: RunResult, key: str) -> list[float]:
    """``key`` of every step's metrics record of ``run``."""
    return [m[key] for m in run.metrics]
