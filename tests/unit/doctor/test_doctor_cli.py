"""``nemo-ac doctor`` through the CLI in this process: the table, and exit code 1 when nemo_ac's version gate is
forced off (``--assume-torch-version 2.12.0``: install() then applies nothing, so the affected probes still fail
with the "workaround"). The full command with every probe runs in tests/functional/test_doctor.py.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from nemo_ac.cli import main
from nemo_ac.workarounds.gates import torch_version_release

pytestmark = [
    pytest.mark.workaround,
    pytest.mark.skipif(torch_version_release() < (2, 13), reason="the verdicts below are torch 2.13's"),
]


@pytest.fixture(autouse=True)
def no_process_group():
    if dist.is_initialized():
        pytest.skip("the doctor makes its own process group")
    before = set(torch_checkpoint.SAC_IGNORED_OPS)
    yield
    assert set(torch_checkpoint.SAC_IGNORED_OPS) == before and not dist.is_initialized()


def test_table_and_exit_0(capsys):
    assert main(["doctor", "--only", "upstream_profiler_ignore", "sac_profiler_ops", "thread_config"]) == 0
    out = capsys.readouterr().out
    assert "| probe | affected | workaround | active | with workaround | time (s) |" in out
    assert out.count("| yes | compat.install() | yes | pass |") == 2
    assert "| yes | compat.forward_thread_compile_context | yes | pass |" in out
    assert "sac_profiler_ops without the workaround: RuntimeError: profiler._record_function_enter_new" in out
    assert "OK: every affected probe passes" in out


def test_gate_forced_off_fails_with_exit_1(capsys):
    argv = ["doctor", "--only", "upstream_profiler_ignore", "sac_profiler_ops", "--assume-torch-version", "2.12.0"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| upstream_", "| sac_"))]
    assert len(rows) == 2 and all("| yes | compat.install() | no | FAIL |" in row for row in rows), out
    assert "gates as for torch 2.12.0" in out and "PROBLEM" in out


def test_doctor_takes_no_overrides(capsys):
    assert main(["doctor", "train.steps=3"]) == 2
    assert "takes no overrides" in capsys.readouterr().err
