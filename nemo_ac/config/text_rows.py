"""What a usable ``data.kind: text`` row is, in one place: the preflight reads a data file's first rows with it
(``config.data_files``) and the loader every row (``data.text``), so both name the same rows for the same reason.

The rule, for every kind of bad row alike: a row that cannot become a training document is a counted skip, never a
crash and never silent. Training skips it, counts it per reason and warns once per reason, naming the file, the
config key and the first row numbers; a run fails only when no row at all is usable (``data.<column>: no usable
rows``). Before this module a chat turn without ``content`` stopped the run with a bare ``KeyError: 'content'``
(from ``message["content"]`` in the tokenizer) while a chat without an assistant turn was a counted skip: one bad
row among millions killed a run after the weights had loaded, and named neither the file nor the row.

Plain text (``data.text_column``): a non-empty string. Chat (``data.messages_column``): a list of turns, each a
mapping with a string ``role`` and a string ``content`` (other keys are ignored), at least one turn with role
``assistant`` (the loss covers only those).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SHOWN_ROWS = 5  # row numbers listed per skip reason


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def text_problem(value: Any) -> tuple[str, str] | None:
    """(reason, detail) why a plain-text cell is no document, or None when it is one."""
    if value is None or value == "":
        return "empty text", "empty"
    if not isinstance(value, str):
        return "text is not a string", f"a {_kind(value)}, not a string"
    return None


def chat_problem(value: Any) -> tuple[str, str] | None:
    """(reason, detail) why a messages cell is no chat document, or None when it is one."""
    if not isinstance(value, list | tuple):
        return "messages is not a list", f"a {_kind(value)}, not a list of {{role, content}} turns"
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            return "malformed turn", f"turn {i} is a {_kind(turn)}, not a {{role, content}} mapping"
        for key in ("role", "content"):
            if turn.get(key) is None:
                keys = ", ".join(map(str, turn)) or "none"
                return "malformed turn", f"turn {i} has no {key!r} (its keys: {keys})"
            if not isinstance(turn[key], str):
                return "malformed turn", f"turn {i}'s {key} is a {_kind(turn[key])}, not a string"
    if not any(turn["role"] == "assistant" for turn in value):
        return "no assistant turn", "no turn has role 'assistant'"
    return None


def row_problem(value: Any, *, chat: bool) -> tuple[str, str] | None:
    return chat_problem(value) if chat else text_problem(value)


@dataclass
class SkippedRows:
    """Skipped rows per reason: how many, the first row numbers and the first row's detail."""

    counts: dict[str, int] = field(default_factory=dict)
    rows: dict[str, list[int]] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)

    def add(self, row: int, reason: str, detail: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        shown = self.rows.setdefault(reason, [])
        if len(shown) < SHOWN_ROWS:
            shown.append(row)
        self.details.setdefault(reason, detail)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self, reason: str) -> str:
        """``no assistant turn: 2 rows (rows 3, 9; row 3: no turn has role 'assistant')``."""
        count, shown, detail = self.counts[reason], self.rows[reason], self.details[reason]
        if count == 1:
            return f"{reason}: 1 row (row {shown[0]}: {detail})"
        listed = ", ".join(map(str, shown)) + (", ..." if count > len(shown) else "")
        return f"{reason}: {count} rows (rows {listed}; row {shown[0]}: {detail})"

    def lines(self) -> Iterable[str]:
        return (self.describe(reason) for reason in self.counts)
