"""Rank 0's terminal: one progress bar when stdout is a terminal, plain lines when it is not, and one way to print.

Why a library bar: the hand-drawn ``\\r`` bar was a fixed 30 characters plus a ~200-character metrics line, so any
terminal narrower than the line wrapped it and every ``\\r`` redraw left a new copy behind; a checkpoint print in the
middle of a run landed on the bar's line. tqdm sizes the line to the terminal on every redraw (``dynamic_ncols``;
the bar shrinks first, then the line is cut at the width), shows elapsed time and an ETA, and ``tqdm.write`` clears
the bar, prints a line above it and redraws it. tqdm rather than rich: one pure-Python module without
dependencies (rich brings pygments and markdown-it), already installed by transformers / datasets / huggingface_hub.

Every line a run prints on rank 0 while the bar may be up (checkpoint saves and resumes, compile progress, the
stop message, the summary) goes through ``echo``, which routes it through the bar when one is shown; so do Python
warnings while the bar is up (``warnings.showwarning``, restored by ``close``).
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time
import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any, TextIO

from tqdm import tqdm

MIN_BAR = 10  # columns the bar keeps at least: metrics after the first that would squeeze it further are dropped
_ACTIVE: list[Progress] = []  # the bar currently shown on this process (at most one)


def echo(message: str, *, file: TextIO | None = None) -> None:
    """Print ``message`` (one or more lines) on this process: above the progress bar when one is shown."""
    if _ACTIVE and _ACTIVE[-1].bar is not None:
        tqdm.write(message, file=file or _ACTIVE[-1].stream)
        return
    stream = file or sys.stdout
    stream.write(message + "\n")
    stream.flush()


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``1:15``; ``3725`` -> ``1:02:05`` (what the plain lines print for elapsed and ETA)."""
    seconds = max(int(seconds), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def use_bar(setting: str, stream: TextIO) -> bool:
    """``logging.progress_bar``: always / never / auto (a bar only when ``stream`` is a terminal)."""
    if setting == "always":
        return True
    if setting == "never":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """The run's progress on rank 0: ``update`` once per optimizer step with the step's short metrics text.

    With a bar: ``step 12/100 |####      | 01:02<07:35, loss 4.1 | 1,234 tok/s | ...`` redrawn in place at the
    terminal's width. Without one (stdout redirected, ``progress_bar: never``): the full metrics line every
    ``log_every`` steps and at the last step, followed by elapsed time and ETA, so a log file reads line by line.
    """

    def __init__(
        self,
        *,
        total_steps: int,
        initial_step: int,
        bar: bool,
        log_every: int,
        stream: TextIO | None = None,
        columns: int | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.initial_step = initial_step
        self.log_every = max(log_every, 1)
        self.stream = stream or sys.stdout
        self.columns = columns  # None: the terminal's width, read at every redraw
        self.started = time.perf_counter()
        self._finished: deque[float] = deque(maxlen=11)  # perf_counter at the last steps' ends (ETA)
        self.bar: Any = None
        if bar:
            self.bar = tqdm(
                total=total_steps,
                initial=initial_step,
                file=self.stream,
                dynamic_ncols=columns is None,
                ncols=columns,
                desc="step",
                unit="step",
                bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}",
                smoothing=0.3,  # step 1 includes compilation: weigh recent steps more for the ETA
                mininterval=0,
                leave=True,
            )
        self._showwarning: Any = None
        if self.bar is not None:  # Python warnings (e.g. EagerFallbackWarning) print above the bar too
            self._showwarning = warnings.showwarning
            warnings.showwarning = self._warning
        _ACTIVE.append(self)

    def _warning(self, message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None):
        echo(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file=sys.stderr)

    def eta_s(self, step: int) -> float | None:
        """Seconds left at the median pace of the last 10 steps (the first step, which compiles, drops out once a
        second one finished); None before the first step."""
        times = list(self._finished)
        if not times:
            return None
        if len(times) == 1:
            pace = times[0] - self.started
        else:
            pace = statistics.median(b - a for a, b in itertools.pairwise(times))
        return pace * (self.total_steps - step)

    def _width(self) -> int:
        if self.columns is not None:
            return self.columns
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):  # not a terminal (progress_bar: always into a file)
            return 200

    def fit(self, parts: Sequence[str]) -> str:
        """As many of ``parts`` (most important first) as leave the bar at least ``MIN_BAR`` columns."""
        fixed = len(f"step {self.total_steps}/{self.total_steps} || 00:00<00:00, ") + 4  # timings may grow
        room = self._width() - fixed - MIN_BAR
        kept: list[str] = []
        for part in parts:
            if len(" | ".join([*kept, part])) > room and kept:
                break
            kept.append(part)
        return " | ".join(kept)

    def update(self, step: int, *, short: Sequence[str], full: str) -> None:
        """Step ``step`` finished: the key metrics ``short`` (most important first; the tail is dropped when the
        terminal is narrow) go on the bar, ``full`` is the plain line."""
        self._finished.append(time.perf_counter())
        if self.bar is not None:
            self.bar.set_postfix_str(self.fit(short), refresh=False)
            self.bar.update(step - self.bar.n)
            return
        if step % self.log_every == 0 or step == self.total_steps:
            elapsed = time.perf_counter() - self.started
            eta = self.eta_s(step)
            timing = f" | elapsed {format_duration(elapsed)}" + (f" | eta {format_duration(eta)}" if eta else "")
            echo(full + timing, file=self.stream)

    def close(self) -> None:
        """Leave the bar on screen as the last progress line; later prints go to the stream directly."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._showwarning is not None:
            warnings.showwarning = self._showwarning
            self._showwarning = None
        if self in _ACTIVE:
            _ACTIVE.remove(self)
