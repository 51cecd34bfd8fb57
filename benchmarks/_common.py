"""Shared pieces of the benchmark scripts: torchrun launches, metrics.jsonl, markdown tables, JSON results.

Not a benchmark itself. Every launch runs in a fresh process group with its own ``logging.run_dir`` and its own
``TORCHINDUCTOR_CACHE_DIR`` (a temporary directory), so compile times are cold and no row warms the next one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
TINY_RECIPE = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"
COMPILE_COUNTS = ("compiles_fwd", "compiles_bwd", "recompiles_fwd", "recompiles_bwd", "graph_breaks", "bwd_graphs")

# A Python exception line ("pkg.mod.SomeError: message"); torchrun's own wrappers are not the root cause.
_ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Unsupported|Desync)\w*): (.*)$")
_WRAPPER_ERRORS = ("ChildFailedError", "SignalException")


@dataclass
class Launch:
    """One ``torchrun`` launch: exit status, wall time, the per-step records of metrics.jsonl, the output's tail."""

    returncode: int
    wall_s: float
    records: list[dict[str, Any]]
    output_tail: str
    timed_out: bool = False
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def status(self) -> str:
        """``ok``, or ``failed: <first error line>`` / ``timeout``, short enough for a table cell."""
        if self.ok:
            return "ok"
        if self.timed_out:
            return f"timeout after {len(self.records)} steps"
        if not self.error:
            return f"failed (exit {self.returncode})"
        return f"failed: {self.error[:100]}…" if len(self.error) > 100 else f"failed: {self.error}"


def add_common_args(parser: argparse.ArgumentParser, *, default_out: str, dtype: bool = True) -> None:
    """``--out``, ``--device`` and (optionally) ``--dtype``."""
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / default_out, help="JSON results path")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    if dtype:
        parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def device_overrides(*, device: str, dtype: str = "float32") -> list[str]:
    """Recipe overrides for the device: gloo on CPU; NCCL on CUDA; bf16 FSDP params (fp32 reduce) when asked."""
    out = ["dist.backend=nccl", "dist.device=cuda"] if device == "cuda" else ["dist.backend=gloo", "dist.device=cpu"]
    if dtype != "float32":
        out.append(f"parallel.fsdp.param_dtype={dtype}")
    return out


def first_error_line(text: str) -> str:
    """The first exception line of a (possibly multi-rank) traceback, skipping torchrun's wrappers."""
    for line in text.splitlines():
        match = _ERROR_LINE.match(line)
        if match and not match.group(1).endswith(_WRAPPER_ERRORS):
            return f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2).strip()}"
    return ""


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The per-step records of ``run_dir/metrics.jsonl`` (empty if the run wrote none)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [record for record in records if "event" not in record]  # start/stop markers are no step records


def launch_train(
    *,
    overrides: Sequence[str],
    run_dir: Path,
    nproc: int = 2,
    recipe: Path = TINY_RECIPE,
    entry: Path | None = None,
    timeout_s: float = 600.0,
    inductor_cache: Path | None = None,
    env: dict[str, str] | None = None,
) -> Launch:
    """``torchrun --standalone --nproc-per-node NPROC -m nemo_ac.train RECIPE overrides...`` (or ``entry``, a
    script taking the same arguments), with ``OMP_NUM_THREADS=1`` unless set and a fresh inductor cache (or
    ``inductor_cache``, shared by launches that want warm compiles); ``env`` adds environment variables."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += [str(entry)] if entry is not None else ["-m", "nemo_ac.train"]
    command += [str(recipe), *overrides, f"logging.run_dir={run_dir}", "logging.progress_bar=never"]
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    child_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {}), "PYTHONPATH": pythonpath}
    child_env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache or run_dir / "inductor_cache")
    started = time.perf_counter()
    timed_out = False
    # torchrun stops its workers on SIGTERM; a plain kill of torchrun would leave the ranks running.
    proc = subprocess.Popen(
        command, cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    returncode = -1 if timed_out else proc.returncode
    wall = time.perf_counter() - started
    (run_dir / "output.log").write_text(output)
    return Launch(
        returncode=returncode,
        wall_s=wall,
        records=read_metrics(run_dir),
        output_tail=output[-4000:],
        timed_out=timed_out,
        error="" if returncode == 0 else first_error_line(output),
    )


def median_step_ms(records: Sequence[dict[str, Any]], *, skip: int) -> float | None:
    """Median ``step_time_s`` (in ms) of the records after the first ``skip`` (warm-up / compile) steps."""
    steady = [r["step_time_s"] for r in records[skip:]]
    return 1000 * statistics.median(steady) if steady else None


def cell(value: Any, *, digits: int = 1) -> str:
    """A table cell: floats rounded, None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value).replace("|", "/")


def markdown_table(*, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table (cells via ``cell``)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """Where the numbers come from."""
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_json(path: Path, *, payload: dict[str, Any], table: str, wall_s: float) -> None:
    """``payload`` plus the machine, the command line, the printed table and the script's wall time."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join([Path(sys.executable).name, *[a if " " not in a else repr(a) for a in sys.argv]])
    data = {"command": command, "machine": machine(), "wall_s": round(wall_s, 1), **payload, "table": table}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path} ({wall_s:.0f} s)", file=sys.stderr)
