"""The plain-FSDP2 example of docs/doctor_and_compat.md (``<!-- readme-example: fsdp2_sac_compat -->``; it was the
README's until the README became an entry), run exactly as printed there.

A script that uses no nemo_ac trainer code: its own SAC policy through torch's ``create_selective_checkpoint_contexts``
and a nested FSDP2 unit inside each checkpointed block. As printed (with ``nemo_ac.compat.install()``) it trains; the
same text without that line fails on torch 2.13 with the documented SAC error.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_ac.workarounds.gates import torch_version_release
from tests.launch import ROOT, child_env

pytestmark = pytest.mark.functional

MARKER = "<!-- readme-example: fsdp2_sac_compat -->"
DOC = ROOT / "docs" / "doctor_and_compat.md"
FIX_LINE = re.compile(r"^nemo_ac\.compat\.install\(\).*\n", re.MULTILINE)
DOCUMENTED = re.compile(
    r"profiler\._record_function_enter_new\.default invocation index \d+ encountered during backward "
    r"but not found in storage"
)
STEP = re.compile(r"^step (\d) loss (\d+\.\d+)$", re.MULTILINE)


def readme_example() -> str:
    text = DOC.read_text()
    assert text.count(MARKER) == 1, f"the example marker must appear exactly once in {DOC.relative_to(ROOT)}"
    block = text.split(MARKER, 1)[1]
    match = re.match(r"\s*```python\n(.*?)```", block, re.DOTALL)
    assert match, "the marker must be followed by a ```python block"
    return match.group(1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_example(source: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """As torchrun --nproc-per-node 1 would start it: the env:// rendezvous variables of a world of one."""
    script = tmp_path / "train_fsdp2_sac.py"
    script.write_text(source)
    env = child_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    return subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )


def test_readme_example_trains(tmp_path):
    proc = run_example(readme_example(), tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    losses = [float(loss) for _, loss in STEP.findall(proc.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0], proc.stdout


@pytest.mark.skipif(torch_version_release() < (2, 13), reason="the profiler-op desync exists from torch 2.13 on")
def test_readme_example_fails_without_install(tmp_path):
    source, removed = FIX_LINE.subn("", readme_example())
    assert removed == 1, "the example must call nemo_ac.compat.install() on a line of its own"
    proc = run_example(source, tmp_path)
    assert proc.returncode != 0 and DOCUMENTED.search(proc.stderr), (proc.stdout + proc.stderr)[-4000:]
    assert not STEP.search(proc.stdout)  # the very first backward fails
