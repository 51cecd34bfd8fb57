"""Static check: does torch itself keep the profiler ops out of SAC's replay, or need to?

Not a run of the FSDP2 failure (``probes_sac.run_profiler_ops_probe`` is) but the question a user of another trainer
asks first: does my torch need ``install()`` at all? Without the workaround: torch's own ``SAC_IGNORED_OPS`` as it
was before nemo_ac touched it. With it: the same set after ``nemo_ac.compat.install()`` (on a private copy).

An op missing from the set only matters where torch's SAC replays the recompute by per-op invocation index
(torch 2.13 on): there a ``record_function`` range that only the recompute opens has no stored entry. torch 2.12's
recompute asks the policy again and simply runs every op it does not save, so missing ops are harmless. The check
asks torch which it is (``recompute_tolerates_extra_profiler_ops``) instead of reading the version, so on 2.12 the
verdict is "not needed", not a failure of a gate that is rightly off.
"""

from __future__ import annotations

import re

import torch
import torch.utils.checkpoint as torch_checkpoint

from nemo_ac import compat
from nemo_ac.doctor.isolation import private_sac_ignored_ops
from nemo_ac.doctor.result import ProbeRun, recording
from nemo_ac.workarounds.profiler_ops_in_sac import profiler_op_overloads

NOT_IGNORED = re.compile(r"not in torch\.utils\.checkpoint\.SAC_IGNORED_OPS")


def _save_nothing(ctx, op, *args, **kwargs) -> torch_checkpoint.CheckpointPolicy:
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def recompute_tolerates_extra_profiler_ops() -> bool:
    """Whether torch's SAC runs a ``record_function`` range that only the recompute opens (what a nested FSDP2
    unit's hooks do), with the ``SAC_IGNORED_OPS`` in force now. False where the recompute looks every op up in
    what the forward stored and the profiler ops are not ignored."""
    recompute = {"extra_range": False}

    def region(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        if recompute["extra_range"]:
            with torch.profiler.record_function("nemo_ac-doctor::recompute-only"):
                y = y * 1.0
        return y.cos()

    x = torch.randn(3, 5, requires_grad=True)
    out = torch_checkpoint.checkpoint(
        region,
        x,
        use_reentrant=False,
        context_fn=lambda: torch_checkpoint.create_selective_checkpoint_contexts(_save_nothing),
    )
    recompute["extra_range"] = True
    try:
        out.sum().backward()
    except RuntimeError as exc:
        if "not found in storage" in str(exc):
            return False
        raise
    return True


def run_upstream_profiler_check(*, workaround: bool, device: str = "cpu", torch_version: str | None = None) -> ProbeRun:
    """Pass when every profiler-op overload is in ``SAC_IGNORED_OPS``, or when this torch's SAC recompute runs
    profiler ops it never stored anyway (device: unused, for a uniform signature)."""
    run = ProbeRun(workaround=workaround)
    with private_sac_ignored_ops(upstream_only=True) as ignored, recording(run, expected=NOT_IGNORED):
        if workaround:
            with compat.installed(torch_version=torch_version) as state:
                run.facts["install"] = state.profiler_ops
                missing = [str(op) for op in profiler_op_overloads() if op not in torch_checkpoint.SAC_IGNORED_OPS]
                tolerated = bool(missing) and recompute_tolerates_extra_profiler_ops()
        else:
            missing = [str(op) for op in profiler_op_overloads() if op not in ignored]
            tolerated = bool(missing) and recompute_tolerates_extra_profiler_ops()
        run.facts["profiler_overloads"] = len(profiler_op_overloads())
        if missing:
            run.facts["recompute_tolerates_missing_ops"] = tolerated
        if not profiler_op_overloads():
            run.detail = "this torch has no profiler record_function ops"
        if missing and tolerated:
            run.detail = (
                f"{len(missing)} profiler ops are not in SAC_IGNORED_OPS, but this torch's SAC recompute asks the "
                "policy again and runs ops it did not store: nothing to ignore"
            )
        elif missing:
            raise RuntimeError(f"{', '.join(missing)} not in torch.utils.checkpoint.SAC_IGNORED_OPS")
    return run
