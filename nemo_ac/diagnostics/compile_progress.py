"""One line per compiled graph while torch.compile works, so a run's first step does not look hung.

On a fresh machine inductor compiles every block layout during step 1, forward at its first call and backward
lazily at its first backward; on CPU that is minutes (``make run``: about 3.5 of a 6-minute run, README "First
run") with nothing on screen. ``CompileProgress`` prints, on the process that installs it::

    compile | fwd graph [0/0] of block 0 (ac_outer) done in 41.3 s (1 graph so far, 52.0 s since start)
    compile | bwd graph of [0/0] done in 30.2 s (2 graphs so far, 83.1 s since start)
    compile | still compiling fwd graph [0/1] of block 1 (ac_outer): 60 s

``[frame/recompile]`` is Dynamo's compile id: a new first number is a new frame, a new second number another
graph of it: the first compile of another block layout (``of block N``: the block layout compiling, from
``diagnostics.recompiles.compiling_layout``) or a recompile (which ``nemo_ac.diagnostics.recompiles`` explains).
A compile that runs longer than ``heartbeat_s`` gets a "still compiling" line every ``heartbeat_s``.

Source: the same Dynamo start/end callbacks as the recompile accounting (private; no public per-compile hook exists
-- ``torch.compiler`` has none, ``torch._logging`` only logs), registered through
``workarounds.dynamo_compile_events.add_compile_callbacks``, which returns None where they are missing: then nothing
is printed. The
callbacks run on the compiling thread; printing is the only thing they do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from nemo_ac.diagnostics.recompiles import current_layout
from nemo_ac.workarounds.dynamo_compile_events import add_compile_callbacks, remove_compile_callbacks

Write = Callable[[str], None]


class CompileProgress:
    """Prints a line when each Dynamo frame compile and each lazily compiled backward graph finishes."""

    def __init__(self, write: Write, *, heartbeat_s: float = 30.0) -> None:
        self.write = write
        self.heartbeat_s = heartbeat_s
        self.started = time.perf_counter()
        self.graphs = 0
        self._lock = threading.Lock()
        self._open: dict[int, tuple[str, float, float]] = {}  # thread -> (what, started, last heartbeat)
        self._handler: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _what(args: Any) -> str:
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        compile_id = str(getattr(args, "compile_id", "?"))
        layout = current_layout()
        where = f" of {layout}" if layout else ""
        return (
            f"bwd graph of [{compile_id}]{where}" if trigger == "LAZY_BACKWARD" else f"fwd graph [{compile_id}]{where}"
        )

    def _on_start(self, args: Any) -> None:
        now = time.perf_counter()
        with self._lock:
            self._open[threading.get_ident()] = (self._what(args), now, now)

    def _on_end(self, args: Any) -> None:
        now = time.perf_counter()
        with self._lock:
            opened = self._open.pop(threading.get_ident(), None)
            if opened is None:
                return
            self.graphs += 1
            what, began, _ = opened
            graphs = self.graphs
        self.write(
            f"compile | {what} done in {now - began:.1f} s ({graphs} graph{'s' if graphs != 1 else ''} so far, "
            f"{now - self.started:.1f} s since start)"
        )

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(self.heartbeat_s, 5.0)):
            now = time.perf_counter()
            lines = []
            with self._lock:
                for ident, (what, began, last) in self._open.items():
                    if now - last >= self.heartbeat_s:
                        self._open[ident] = (what, began, now)
                        lines.append(f"compile | still compiling {what}: {now - began:.0f} s")
            for line in lines:
                self.write(line)

    def compiling(self) -> bool:
        """True while a graph compiles on some thread (between Dynamo's start and end callbacks). Read without the
        lock: the stop's line asks from a signal handler, which may have interrupted this thread holding it."""
        return bool(self._open)

    def install(self) -> CompileProgress:
        self._handler = add_compile_callbacks(self._on_start, self._on_end)
        if self._handler is None:
            return self
        if self.heartbeat_s > 0:
            self._thread = threading.Thread(target=self._heartbeat, name="nemo_ac-compile-progress", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        remove_compile_callbacks(self._handler, self._on_start, self._on_end)
        self._handler = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> CompileProgress:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.close()
