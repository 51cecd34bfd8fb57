"""Static check: does torch itself keep the profiler ops out of SAC's replay?

Not a run of the failure (``probes_sac.run_profiler_ops_probe`` is) but the question a user of another trainer
asks first: does my torch need ``install()`` at all? Without the workaround: torch's own ``SAC_IGNORED_OPS`` as it
was before nemo_ac touched it. With it: the same set after ``nemo_ac.compat.install()`` (on a private copy).
"""

from __future__ import annotations

import re

import torch.utils.checkpoint as torch_checkpoint

from nemo_ac import compat
from nemo_ac.doctor.isolation import private_sac_ignored_ops
from nemo_ac.doctor.result import ProbeRun, recording
from nemo_ac.workarounds.profiler_ops_in_sac import profiler_op_overloads

NOT_IGNORED = re.compile(r"not in torch\.utils\.checkpoint\.SAC_IGNORED_OPS")


def run_upstream_profiler_check(*, workaround: bool, device: str = "cpu", torch_version: str | None = None) -> ProbeRun:
    """Pass when every profiler-op overload is in ``SAC_IGNORED_OPS`` (device: unused, for a uniform signature)."""
    run = ProbeRun(workaround=workaround)
    with private_sac_ignored_ops(upstream_only=True) as ignored, recording(run, expected=NOT_IGNORED):
        if workaround:
            with compat.installed(torch_version=torch_version) as state:
                run.facts["install"] = state.profiler_ops
                missing = [str(op) for op in profiler_op_overloads() if op not in torch_checkpoint.SAC_IGNORED_OPS]
        else:
            missing = [str(op) for op in profiler_op_overloads() if op not in ignored]
        run.facts["profiler_overloads"] = len(profiler_op_overloads())
        if not profiler_op_overloads():
            run.detail = "this torch has no profiler record_function ops"
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not in torch.utils.checkpoint.SAC_IGNORED_OPS")
    return run
