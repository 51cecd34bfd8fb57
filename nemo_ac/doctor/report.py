"""The doctor's output: a table for people, JSON for machines, and the exit code."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from nemo_ac.doctor.checks import CheckResult
from nemo_ac.doctor.result import Verdict


@dataclass
class DoctorReport:
    torch_version: str
    assumed_torch_version: str | None
    device: str
    verdicts: list[Verdict] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)  # the private torch techniques (doctor.checks)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """False when any affected probe still fails with its workaround, a probe could not decide, or a private
        torch technique nemo_ac relies on is broken on this torch."""
        return not any(verdict.failed for verdict in self.verdicts) and all(check.ok for check in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "torch": self.torch_version,
            "assumed_torch_version": self.assumed_torch_version,
            "device": self.device,
            "seconds": round(self.seconds, 1),
            "ok": self.ok,
            "probes": [verdict.to_dict() for verdict in self.verdicts],
            "checks": [check.to_dict() for check in self.checks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def render_table(report: DoctorReport) -> str:
    """A markdown table (readable in a terminal, pasteable into an issue) plus what failed without each fix."""
    assumed = f" (gates as for torch {report.assumed_torch_version})" if report.assumed_torch_version else ""
    lines = [
        f"nemo-ac doctor: torch {report.torch_version}{assumed}, device {report.device}",
        "",
        "| probe | affected | workaround | active | with workaround | time (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for v in report.verdicts:
        seconds = v.off.seconds + v.on.seconds
        lines.append(
            f"| {v.name}: {v.title} | {_yes_no(v.affected)} | {v.workaround} | {_yes_no(v.workaround_active)} | "
            f"{v.status} | {seconds:.1f} |"
        )
    lines.append("")
    for v in report.verdicts:
        if v.affected and not v.off.ok:
            lines.append(f"- {v.name} without the workaround: {v.off.summary}")
        if not v.on.ok:
            lines.append(f"- {v.name} WITH the workaround: {v.on.summary}")
        elif v.status == "error" and not v.off.ok:
            lines.append(f"- {v.name} failed unexpectedly: {v.off.summary}")
        if v.note:
            lines.append(f"- {v.name}: {v.note}")
    if report.checks:
        lines += [
            "",
            "| private torch nemo_ac relies on | workarounds module | state | time (s) |",
            "| --- | --- | --- | --- |",
        ]
        for check in report.checks:
            state = "ok" if check.ok else f"BROKEN: {check.error}"
            lines.append(f"| {check.title} | {check.row} | {state} | {check.seconds:.1f} |")
    verdict = "OK: every affected probe passes with its workaround" if report.ok else "PROBLEM: see FAIL / error rows"
    lines += ["", f"{verdict}. Wall time {report.seconds:.1f} s."]
    return "\n".join(lines)
