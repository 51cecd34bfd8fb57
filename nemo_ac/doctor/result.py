"""One run of a probe, and how a probe's runs with and without its workaround become a verdict."""

from __future__ import annotations

import re
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ProbeRun:
    """The outcome of one probe run (workaround off or on). A failure is data here, never an exception.

    signature: whether the failure is the one the probe is about (its documented error text); a run that fails
    for another reason says nothing about the torch bug and makes the verdict ``error``.
    """

    workaround: bool
    ok: bool = False
    error_type: str | None = None
    error: str | None = None
    summary: str = ""  # first line of the root error (torch's own message when nemo_ac re-raised it)
    signature: bool = False
    detail: str = ""
    seconds: float = 0.0
    facts: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeRun:
        return cls(**data)


def first_line(text: str, *, limit: int = 400) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:limit]


@contextmanager
def recording(run: ProbeRun, *, expected: re.Pattern[str]) -> Iterator[ProbeRun]:
    """Time the body; an exception marks the run failed, with its type, its message (and its cause's) and whether
    it matches ``expected``. ``run.ok`` is set True only when the body completes."""
    start = time.perf_counter()
    try:
        yield run
        run.ok = True
    except Exception as exc:
        cause = exc.__cause__
        text = f"{exc}" + (f" (caused by {type(cause).__name__}: {cause})" if cause is not None else "")
        run.ok = False
        run.error_type = type(exc).__name__
        run.error = text[:2000]
        run.summary = f"{type(cause or exc).__name__}: {first_line(str(cause or exc))}"
        run.signature = bool(expected.search(text))
        if not run.signature:
            run.detail = (run.detail + " " + traceback.format_exc(limit=-3)[-1500:]).strip()
    finally:
        run.seconds = round(time.perf_counter() - start, 2)


@dataclass
class Verdict:
    """One row of the doctor's table.

    affected: the probe fails without the workaround, with the documented error (None: the probe itself failed
        for another reason, see ``status``).
    workaround_active: nemo_ac's gate enables the workaround on this torch (what ``compat.install()`` and the
        helpers do here).
    status: ``pass`` (with the workaround the probe passes), ``not needed`` (not affected: upstream torch handles
        it), ``FAIL`` (affected and still failing with the workaround), ``error`` (a run failed in an unexpected
        way: the doctor cannot tell).
    """

    name: str
    title: str
    workaround: str
    affected: bool | None
    workaround_active: bool
    status: str
    off: ProbeRun
    on: ProbeRun
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("FAIL", "error")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["failed"] = self.failed
        return data


def judge(
    *, name: str, title: str, workaround: str, workaround_active: bool, off: ProbeRun, on: ProbeRun, note: str = ""
) -> Verdict:
    """Turn the two runs into a verdict (see ``Verdict.status``)."""
    if not off.ok and not off.signature:
        affected, status = None, "error"
    else:
        affected = not off.ok
        if on.ok:
            status = "pass" if affected else "not needed"
        else:
            status = "FAIL" if on.signature else "error"
    return Verdict(
        name=name,
        title=title,
        workaround=workaround,
        affected=affected,
        workaround_active=workaround_active,
        status=status,
        off=off,
        on=on,
        note=note,
    )
