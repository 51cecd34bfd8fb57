"""The one torch-version gate table: which torch releases each workaround is switched on for.

A workaround is on when the running torch's release tuple lies in ``[since, until)``. Release tuples drop
pre-release and local suffixes, so ``2.13.0a0+8145d630e8`` (NGC) and ``2.13.0.dev20260101`` (nightly) count as
2.13: those builds already carry the release's FSDP2 and Dynamo code. ``until`` stays None until a torch release
is verified to fix the failure (``nemo-ac doctor`` on that release says so); then set it, and the workaround turns
itself off there.

Workarounds whose need is a property of the build rather than of its version (a fake rule's dtype list) are not
gated here: they ask torch directly at import (``grouped_mm_fake_rule``) and say so in the registry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")

Release = tuple[int, ...]


def torch_version_release(version: str | None = None) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a torch version string (default: the running torch).

    Pre-release and local suffixes are dropped, so ``2.13.0a0+8145d630e8`` and ``2.13.0.dev20260101`` are
    ``(2, 13, 0)``. Unparseable -> ``(0, 0, 0)`` (every gate stays off).
    """
    text = str(torch.__version__ if version is None else version)
    match = _RELEASE.match(text)
    if match is None:
        return (0, 0, 0)
    return (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))


@dataclass(frozen=True)
class TorchGate:
    """Affected torch releases: ``since <= release < until`` (``until`` None: no fixed release known)."""

    since: Release
    until: Release | None = None
    verified_on: str = "2.13.0"  # the releases the failure and the workaround were reproduced on (doctor)

    def active(self, torch_version: str | None = None) -> bool:
        release = torch_version_release(torch_version)
        return release >= self.since and (self.until is None or release < self.until)

    def describe(self) -> str:
        if self.since <= (0,) and self.until is None:
            return f"every release (seen on {self.verified_on})"
        since = ".".join(map(str, self.since))
        return f">= {since}" if self.until is None else f"{since} to < {'.'.join(map(str, self.until))}"


# One row per version-gated workaround (the registry's ``gate`` names a row). Re-checked on 2026-12-01 with
# ``nemo-ac doctor`` on torch 2.12.1, 2.13.0, 2.14.1 and 2.15.0 (README: torch compatibility): every row below is
# affected exactly where it is active, and no release up to 2.15.0 fixes one (every ``until`` stays None).
VERIFIED_ON = "2.13.0, 2.14.1, 2.15.0"
GATES: dict[str, TorchGate] = {
    # torch 2.13's SAC replays the recompute by (op, invocation index) from what the forward stored and no longer
    # asks the policy again, so an op that only the recompute runs (FSDP2's record_function profiler ops) has no
    # entry. torch 2.12.1's recompute asks the policy and runs every op it does not save: not affected there
    # (doctor: sac_profiler_ops not affected), although FSDP2 uses record_function on 2.12 as well.
    "profiler_ops_in_sac": TorchGate(since=(2, 13), verified_on=VERIFIED_ON),
    # The same 2.13 replay by invocation index: FSDP2's all-gather ops that only the recompute runs (explicit
    # prefetch) have no entry. 2.12.1: not affected (doctor: sac_fsdp_prefetch passes without the workaround;
    # nemo_ac's own policy never caches fsdp / c10d / mutating ops, which 2.12's recompute then simply runs).
    "fsdp_hooks_in_sac": TorchGate(since=(2, 13), verified_on=VERIFIED_ON),
    # Dynamo / compiler config became per thread (ContextVar) in 2.12 (pytorch#173568).
    "forward_thread_compile_config": TorchGate(since=(2, 12), verified_on="2.12.1, " + VERIFIED_ON),
    # Selective AC over an inductor-compiled block caches references into inductor-owned buffers.
    "compiled_regions_under_sac": TorchGate(since=(2, 12), verified_on=VERIFIED_ON),
    # Per-micro-batch Python ints specialize and recompile per value unless declared dynamic (every release).
    "dynamic_per_batch_ints": TorchGate(since=(0,), verified_on=VERIFIED_ON),
}


def gate(name: str) -> TorchGate:
    try:
        return GATES[name]
    except KeyError:
        raise KeyError(f"no torch gate named {name!r}; known: {sorted(GATES)}") from None


def gate_active(name: str, *, torch_version: str | None = None) -> bool:
    """Whether nemo_ac switches workaround ``name`` on for ``torch_version`` (default: the running torch)."""
    return gate(name).active(torch_version)


# The torch releases nemo_ac supports (pyproject's ``torch>=2.12,<2.16``): the gates above are verified on these only.
SUPPORTED_RELEASES: tuple[Release, Release] = ((2, 12), (2, 16))


def unsupported_torch_note(torch_version: str | None = None) -> str | None:
    """One line for a run's header where the running torch lies outside ``SUPPORTED_RELEASES`` (a source checkout
    on a machine's own torch, which pip's pin never saw), else None. A warning, not a refusal: the run may work, but
    which torch failures it meets there is unknown."""
    release = torch_version_release(torch_version)
    low, high = SUPPORTED_RELEASES
    if low <= release < high:
        return None
    text = str(torch.__version__ if torch_version is None else torch_version)
    return (
        f"torch | {text} is outside nemo_ac's supported {low[0]}.{low[1]} - {high[0]}.{high[1] - 1}: the workarounds "
        "are verified there only (nemo-ac doctor probes this torch; pip install 'torch>=2.12,<2.16')"
    )
