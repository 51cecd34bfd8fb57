"""The stop deadline (nemo_ac/trainer/stop.py) in real processes: a signal that the run cannot turn into a step-end
save within ``train.stop_deadline_s`` ends the process with one line naming the phase and the checkpoint that
stands, kills what the process started, and exits 128 + signum; a stop whose line was printed in time is left alone.
Plus the pieces around it: the key's validation and launch's silence on such an exit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from nemo_ac.config import ConfigError, load_recipe, validate_recipe
from nemo_ac.launch import failure_line
from nemo_ac.trainer.stop import standing_checkpoint

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import os, signal, subprocess, sys, time
from pathlib import Path
from nemo_ac.trainer.stop import StopSignal, standing_checkpoint
stop = StopSignal(deadline_s=float(sys.argv[1])).install()
root = Path(sys.argv[2])
stop.configure(standing=lambda: standing_checkpoint(root, resume_auto=True), phase_detail=lambda: " (compiling)")
stop.enter(sys.argv[3])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
if sys.argv[4] == "finish":
    stop.finish("nemo_ac: SIGTERM at step 3: checkpoint saved", write=lambda line: print(line, file=sys.stderr))
while True:  # a step that never ends (a compile, a hung save, a hung teardown)
    time.sleep(0.05)
"""


def _checkpoint(root: Path, step: int) -> Path:
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "nemo_ac_checkpoint.json").write_text(json.dumps({"step": step}))
    return path


def _run(tmp_path: Path, *, phase: str, finish: bool, deadline: float = 1.0) -> subprocess.CompletedProcess:
    """The script's process to its end. Its step never ends by itself: only the deadline ends it, so a missing
    deadline shows as ``subprocess.TimeoutExpired`` (no wall-clock bound is asserted: it would measure the load)."""
    root = tmp_path / "ckpt"
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(deadline), str(root), phase, "finish" if finish else "-"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def _gone(pid: int) -> bool:
    psutil = pytest.importorskip("psutil")
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_deadline_ends_a_stuck_save_naming_the_checkpoint_before_it(tmp_path) -> None:
    root = tmp_path / "ckpt"
    previous = _checkpoint(root, 3)
    (root / ".step_4.partial").mkdir()  # the save the deadline cuts short: never named, never loaded
    proc = _run(tmp_path, phase="the checkpoint save of step 4", finish=False)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stderr.splitlines() == [
        f"nemo_ac: SIGTERM during the checkpoint save of step 4 (compiling): still running train.stop_deadline_s=1 s "
        f"after it; nothing new saved; the last complete checkpoint is {previous} (rerun the same command to "
        "continue); exiting with 143"
    ]
    assert _gone(int(proc.stdout.split()[0]))  # the process it started did not outlive it


def test_a_stop_line_printed_in_time_is_left_alone(tmp_path) -> None:
    """The loop's own stop line came first (its step was saved): the deadline then only ends a hung teardown, with
    exit code 0 and no second line."""
    proc = _run(tmp_path, phase="the run's summary", finish=True, deadline=0.5)
    assert proc.returncode == 0 and proc.stderr.splitlines() == ["nemo_ac: SIGTERM at step 3: checkpoint saved"]


def test_standing_checkpoint_names_the_newest_complete_one(tmp_path) -> None:
    root = tmp_path / "ckpt"
    assert standing_checkpoint(root, resume_auto=False) == f"nothing saved (no complete checkpoint under {root})"
    _checkpoint(root, 2)
    newest = _checkpoint(root, 5)
    (root / "step_7").mkdir()  # no manifest: not complete
    assert standing_checkpoint(root, resume_auto=False) == (
        f"nothing new saved; the last complete checkpoint is {newest} (resume with checkpoint.resume=auto to continue)"
    )


def test_stop_deadline_must_be_positive() -> None:
    recipe = load_recipe(ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml", ["train.stop_deadline_s=0"])
    with pytest.raises(ConfigError, match=r"train.stop_deadline_s: must be a finite number of seconds > 0"):
        validate_recipe(recipe, world_size=2)
    assert load_recipe(ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml").train.stop_deadline_s == 20.0


def test_launch_adds_no_line_for_a_rank_that_stopped_on_a_signal() -> None:
    def failed(exitcode: int) -> ChildFailedError:
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="<N/A>")
        return ChildFailedError(name="nemo_ac.train", failures={0: failure})

    assert failure_line(failed(143)) == (None, 143)  # rank 0's stop line said what stands
    assert failure_line(failed(130)) == (None, 130)
    assert failure_line(failed(1)) == ("nemo-ac train: rank 0 exited with code 1", 1)
