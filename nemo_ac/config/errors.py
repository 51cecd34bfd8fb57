"""The one error type a bad recipe raises, with every problem found, each naming its key and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigIssue:
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class ConfigError(ValueError):
    """A recipe that cannot run. Raised before any process group exists.

    ``issues`` holds every problem found (not only the first), so one edit round fixes a recipe.
    """

    def __init__(self, issues: Sequence[ConfigIssue] | ConfigIssue | str, *, source: str | None = None) -> None:
        if isinstance(issues, str):
            issues = [ConfigIssue("", issues)]
        elif isinstance(issues, ConfigIssue):
            issues = [issues]
        self.issues: list[ConfigIssue] = list(issues)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {issue}" for issue in self.issues)
        super().__init__(f"invalid recipe{where} ({len(self.issues)} problem(s)):\n{lines}")

    @property
    def keys(self) -> list[str]:
        return [issue.key for issue in self.issues]


def closest(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The candidate a typo most likely meant, or None."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str], *, prefix: str = "") -> str:
    guess = closest(name, candidates)
    if not guess:
        return ""
    return f" Did you mean '{prefix}.{guess}'?" if prefix else f" Did you mean '{guess}'?"
