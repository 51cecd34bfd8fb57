"""SIGTERM / SIGINT on real torchrun launches: every rank finishes the step, the step is saved, one line, exit.

The deterministic trigger (``NEMO_AC_TEST_SIGNAL_AFTER_STEP``: the last rank SIGTERMs itself after that step, so
rank 0 learns of it only through the per-step all-reduce) pins the stop step for the bitwise resume check; a real
SIGTERM sent to the torchrun process mid-run is the cluster's preemption.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import RECIPES, ROOT, child_env, run_recipe, torchrun_command

pytestmark = pytest.mark.functional

RECIPE = "tiny/qwen3_moe_tiny.yaml"
STEPS = 8
COMMON = [f"train.steps={STEPS}", "checkpoint.enabled=true", "checkpoint.resume=auto", "checkpoint.every_n_steps=0"]


def test_self_signal_saves_the_step_and_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    reference = run_recipe(RECIPE, nproc=2, run_dir=tmp_path / "reference", overrides=COMMON).check()
    run_dir = tmp_path / "run"
    stopped = run_recipe(
        RECIPE, nproc=2, run_dir=run_dir, overrides=COMMON, env={"NEMO_AC_TEST_SIGNAL_AFTER_STEP": "3"}
    ).check()  # exit 0: the stop was asked for and is saved
    ckpt = run_dir / "checkpoints"  # checkpoint.dir defaults to <logging.run_dir>/checkpoints
    line = f"nemo_ac: SIGTERM at step 3: checkpoint saved to {ckpt / 'step_3'}; rerun the same command to continue"
    assert line in stopped.output, stopped.output[-3000:]
    assert "Traceback" not in stopped.output
    assert len(stopped.output.splitlines()) <= 15, stopped.output
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_3"]
    assert stopped.summary["stopped_by"] == "SIGTERM" and stopped.summary["steps"] == 3
    assert stopped.losses == reference.losses[:3]

    resumed = run_recipe(RECIPE, nproc=2, run_dir=run_dir, overrides=COMMON).check()
    assert f"resumed from {ckpt / 'step_3'} at step 3" in resumed.output
    assert [m["step"] for m in resumed.metrics] == list(range(1, STEPS + 1))
    assert resumed.losses == reference.losses  # bitwise
    assert [m["lr"] for m in resumed.metrics] == [m["lr"] for m in reference.metrics]
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"event"' in x]
    assert [(e["event"], e.get("resumed_from_step", e.get("at_step"))) for e in events] == [
        ("start", 0),
        ("stop", 3),
        ("start", 3),
    ]


def wait_for_step(proc: subprocess.Popen, metrics: Path, *, step: int, log: Path) -> None:
    """Until ``metrics`` holds ``step`` (at most 300 s); the run must still be going then."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and f'"step": {step},' in metrics.read_text():
            break
        time.sleep(0.05)
    assert proc.poll() is None, log.read_text()[-3000:]


def test_sigterm_to_torchrun_mid_run_saves_and_exits_within_seconds(tmp_path):
    run_dir = tmp_path / "run"
    args = ["-m", "nemo_ac.train", str(RECIPES / RECIPE), f"logging.run_dir={run_dir}", "logging.progress_bar=never"]
    args += [*COMMON, "train.steps=500"]
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(torchrun_command(2, args), env=child_env(), cwd=ROOT, stdout=out, stderr=out)
        metrics = run_dir / "metrics.jsonl"
        wait_for_step(proc, metrics, step=3, log=log)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    output = log.read_text()
    (stop,) = [json.loads(x) for x in metrics.read_text().splitlines() if '"event": "stop"' in x]
    step = stop["at_step"]
    ckpt = run_dir / "checkpoints" / f"step_{step}"
    print(
        f"SIGTERM after step 3 was logged; stopped at step {step}; exit after {took:.2f} s; {len(output.splitlines())} lines"
    )
    assert 3 <= step < 500
    assert f"nemo_ac: SIGTERM at step {step}: checkpoint saved to {ckpt}" in output, output[-3000:]
    assert (ckpt / "nemo_ac_checkpoint.json").exists()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert took < 15, output[-3000:]
    # No rank prints a traceback; what remains is torchrun's own report of the signal it got (its exit is non-zero).
    assert "nemo_ac/" not in "".join(line for line in output.splitlines() if line.strip().startswith("File "))
    ours, _, torchruns = output.partition("Traceback (most recent call last)")
    assert torchruns == "" or torchruns.rstrip().endswith(f"SignalException: Process {proc.pid} got signal: 15"), output
    # start-up lines (with the flops line), one per step, save, summary, the stop line; torchrun's shutdown logs
    assert len(ours.splitlines()) <= step + 13, output


def test_sigterm_to_nemo_ac_train_reaches_torchrun_and_ends_with_one_line(tmp_path):
    """``nemo-ac train`` execs torchrun (nemo_ac.launch): the pid it started is the agent, the ranks are its children,
    and a SIGTERM to it ends with rank 0's stop line only: no traceback, no per-rank shutdown logs."""
    import psutil

    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "nemo_ac.cli", "train", str(RECIPES / RECIPE), "--nproc-per-node", "2"]
    command += [f"logging.run_dir={run_dir}", "logging.progress_bar=never", *COMMON, "train.steps=500"]
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=child_env(), cwd=ROOT, stdout=out, stderr=out)
        metrics = run_dir / "metrics.jsonl"
        wait_for_step(proc, metrics, step=3, log=log)
        agent = psutil.Process(proc.pid)
        assert "nemo_ac.launch" in agent.cmdline()  # exec'd: the same pid is torchrun's agent now
        assert len([c for c in agent.children() if "nemo_ac.train" in c.cmdline()]) == 2
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    output = log.read_text()
    (stop,) = [json.loads(x) for x in metrics.read_text().splitlines() if '"event": "stop"' in x]
    step = stop["at_step"]
    assert proc.returncode == 128 + signal.SIGTERM
    after = output.split("summary | ", 1)[1].splitlines()[1:]  # what follows the run's summary line
    assert after == [
        f"nemo_ac: SIGTERM at step {step}: checkpoint saved to {run_dir / 'checkpoints' / f'step_{step}'}; "
        "rerun the same command to continue"
    ], output[-3000:]
    assert "Traceback" not in output and "closing signal" not in output and "death signal" not in output
