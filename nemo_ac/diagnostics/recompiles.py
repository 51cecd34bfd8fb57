"""Per-thread torch.compile accounting: compiles, recompiles (with reasons), graph breaks, eager fallbacks.

Why per thread: since torch 2.12 Dynamo's config is per thread, and with AC(compile(block)) the recompute
compiles during backward, which on GPU runs on the autograd device thread. A healthy run compiles on the training
thread in its first steps and then never again, on no thread; compiles that keep appearing on the backward thread
are the symptom of a recompute running without the forward thread's settings (see nemo_ac.distributed.compile).

Sources (private to Dynamo, each behind one function of ``workarounds.dynamo_compile_events``, resolved
defensively; none changes what torch does):
- Dynamo's callback handler's start/end callbacks: run on the compiling thread for every Dynamo frame compile and
  every lazily compiled AOTAutograd backward graph -> per-thread counts, and graph breaks as the growth of Dynamo's
  ``graph_break`` counter during that compile.
- Dynamo's compilation metrics: recompile reasons, joined to the thread by compile id.
- the block layout being compiled (``compiling_layout``, set around every compiled block's call by
  ``nemo_ac.distributed.compile``), read at each compile's start: a frame's first compile under a block layout it
  has not compiled for yet (Qwen3.5's ``linear_attn`` block after its ``self_attn`` block: one code object, two
  graphs) is a *new layout*, counted apart from a recompile, which is a frame compiling again for a layout it
  already has a graph for.
- automatic dynamic: a recompile whose reason is ``tensor '...' size mismatch at index N`` means a size Dynamo
  specialized on at the first compile changed (a per-row size not declared dynamic): counted as
  ``dynamic_recompiles``, a failure of the compile setup (``nemo_ac.workarounds.dynamic_per_batch_ints``).
- the warning Dynamo logs on ``torch._dynamo.convert_frame`` when a frame hits its recompile limit: from then on
  the frame runs eagerly. Turned into an ``EagerFallbackWarning`` (loud, per thread); so is a compile(AC(block))
  entry frame that captured no graph (a graph break inside a traced checkpoint makes Dynamo skip the region).

This module imports nothing from nemo_ac.distributed / trainer (diagnostics are used by them, not the reverse).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nemo_ac.workarounds.dynamo_compile_events import (
    add_compile_callbacks,
    compilation_metrics,
    graph_break_total,
    remove_compile_callbacks,
)

log = logging.getLogger("nemo_ac.compile")

FORWARD = "fwd"  # the thread that installed the accounting: the training loop's
OTHER = "bwd"  # every other thread: the autograd device thread on GPU, train.backward_on_thread on CPU
UNKNOWN = "unknown"

_LIMIT_LOGGER = "torch._dynamo.convert_frame"
_LIMIT_PREFIX = "torch._dynamo hit config."
# Dynamo's guard-failure text for a tensor size that changed since the first compile (automatic dynamic follows).
AUTOMATIC_DYNAMIC_REASON = "size mismatch"

_layout_state = threading.local()


@contextlib.contextmanager
def compiling_layout(key: str) -> Iterator[None]:
    """Name the block layout whose compiled code runs on this thread (nested: the innermost wins, restored).

    ``CompileAccounting`` reads it when a compile starts, so the first compile of a frame for a new layout is told
    apart from a recompile. Thread-local: the recompute of AC(compile(block)) sets it again on its own thread.
    """
    previous = getattr(_layout_state, "key", None)
    _layout_state.key = key
    try:
        yield
    finally:
        _layout_state.key = previous


def current_layout() -> str | None:
    """The innermost ``compiling_layout`` key on this thread (None outside every compiled block)."""
    return getattr(_layout_state, "key", None)


def is_automatic_dynamic(reason: str) -> bool:
    """Whether a recompile reason is a tensor size that changed after the first compile specialized on it."""
    return AUTOMATIC_DYNAMIC_REASON in reason


class EagerFallbackWarning(RuntimeWarning):
    """A compiled block (or a piece of one) runs eagerly from now on."""


@dataclass
class ThreadCounts:
    """Cumulative counts of one thread class (fwd / bwd)."""

    compiles: int = 0  # Dynamo frame compiles
    layout_compiles: int = 0  # of which first compiles of an already compiled frame for a new block layout
    recompiles: int = 0  # of which recompiles of a frame for a layout it already has a graph for
    dynamic_recompiles: int = 0  # of those, automatic dynamic ("size mismatch"): a failure
    graph_breaks: int = 0
    backward_graphs: int = 0  # AOTAutograd backward graphs compiled lazily at their first backward
    reasons: Counter = field(default_factory=Counter)  # recompile reason (first line) -> count
    frames: Counter = field(default_factory=Counter)  # compiled code ("name (file:line)") -> compiles


@dataclass(frozen=True)
class EagerFallback:
    thread: str
    code: str
    reason: str

    def message(self) -> str:
        return (
            f"nemo_ac: EAGER FALLBACK on the {self.thread} thread: {self.code} runs eagerly from now on ({self.reason})"
        )


class _LimitHitHandler(logging.Handler):
    def __init__(self, accounting: CompileAccounting) -> None:
        super().__init__(level=logging.WARNING)
        self.accounting = accounting

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, str) or not record.msg.startswith(_LIMIT_PREFIX):
            return
        args = record.args if isinstance(record.args, tuple) else ()
        limit = f"{args[0]}={args[1]}" if len(args) >= 2 else "recompile limit"
        code = str(args[2]) if len(args) >= 3 else "a compiled frame"
        reason = str(args[3]).splitlines()[0] if len(args) >= 4 and args[3] else "no reason recorded"
        self.accounting._fallback(
            EagerFallback(
                thread=self.accounting._label(record.thread),
                code=code,
                reason=f"hit {limit}; last recompile reason: {reason}",
            ),
            from_log=True,
        )


class CompileAccounting:
    """Counts compile events per thread class while installed (use as a context manager or install/close).

    watch_checkpoint_entries: ``(co_filename, co_firstlineno)`` of compiled functions that trace a checkpoint
        (compile(AC(block))); one that compiles to an empty graph ran its whole checkpoint eagerly.
    """

    def __init__(self, *, watch_checkpoint_entries: Iterable[tuple[str, int]] = ()) -> None:
        self.forward_ident = threading.get_ident()
        self.watch = set(watch_checkpoint_entries)
        self.threads = {FORWARD: ThreadCounts(), OTHER: ThreadCounts()}
        self.fallbacks: list[EagerFallback] = []
        self._lock = threading.Lock()
        # thread ident -> (label, trigger, compile id, graph breaks before, layout)
        self._open: dict[int, tuple[str, str, str, int, str | None]] = {}
        self._compile_thread: dict[str, tuple[str, str | None]] = {}  # Dynamo compile id -> (label, layout)
        self._frame_layouts: set[tuple[str, str | None]] = set()  # (compiled code, layout) with a graph
        self._seen_metrics: set[tuple[Any, ...]] = set()
        self._handler: Any | None = None
        self._log_handler: _LimitHitHandler | None = None
        self._limit_hits_logged = 0  # reported by the log handler, not yet matched to a metrics entry

    # -- lifecycle -------------------------------------------------------------------------------------------
    def install(self) -> CompileAccounting:
        self._seen_metrics = {self._metrics_key(m) for m in compilation_metrics()}  # earlier compiles are not ours
        self._handler = add_compile_callbacks(self._on_start, self._on_end)
        if self._handler is None:
            log.warning("Dynamo's callback handler not found: per-thread compile counts are unavailable")
        self._log_handler = _LimitHitHandler(self)
        logging.getLogger(_LIMIT_LOGGER).addHandler(self._log_handler)
        return self

    def close(self) -> None:
        remove_compile_callbacks(self._handler, self._on_start, self._on_end)
        self._handler = None
        if self._log_handler is not None:
            logging.getLogger(_LIMIT_LOGGER).removeHandler(self._log_handler)
            self._log_handler = None

    def __enter__(self) -> CompileAccounting:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- callbacks (run on the compiling thread) ---------------------------------------------------------------
    def _label(self, ident: int | None = None) -> str:
        ident = threading.get_ident() if ident is None else ident
        return FORWARD if ident == self.forward_ident else OTHER

    def _on_start(self, args: Any) -> None:
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        compile_id = str(getattr(args, "compile_id", ""))
        with self._lock:
            self._open[threading.get_ident()] = (
                self._label(),
                trigger,
                compile_id,
                graph_break_total(),
                current_layout(),
            )

    def _on_end(self, args: Any) -> None:
        with self._lock:
            opened = self._open.pop(threading.get_ident(), None)
            if opened is None:
                return
            label, trigger, compile_id, breaks_before, layout = opened
            counts = self.threads[label]
            counts.graph_breaks += max(graph_break_total() - breaks_before, 0)
            if trigger == "LAZY_BACKWARD":
                counts.backward_graphs += 1
            elif trigger == "DYNAMO":
                counts.compiles += 1
                self._compile_thread[compile_id] = (label, layout)

    def _fallback(self, fallback: EagerFallback, *, from_log: bool = False) -> None:
        with self._lock:
            self.fallbacks.append(fallback)
            self._limit_hits_logged += int(from_log)
        warnings.warn(fallback.message(), EagerFallbackWarning, stacklevel=2)
        log.error(fallback.message())

    # -- joining Dynamo's compilation metrics ----------------------------------------------------------------------
    @staticmethod
    def _metrics_key(entry: Any) -> tuple[Any, ...]:
        return (entry.compile_id, entry.is_forward, entry.start_time_us, entry.co_name)

    def refresh(self) -> None:
        """Fold new compilation-metrics entries in (recompile reasons, empty checkpoint graphs). Cheap."""
        for entry in compilation_metrics():
            key = self._metrics_key(entry)
            if key in self._seen_metrics:
                continue
            self._seen_metrics.add(key)
            if entry.is_forward is False:
                continue
            joined = self._compile_thread.get(str(entry.compile_id))
            reason = (entry.recompile_reason or "").splitlines()[0] if entry.recompile_reason else ""
            if joined is None:
                # Never reached the compile callbacks: Dynamo gave up before compiling (recompile limit). The log
                # handler reported it with its thread; report it here only if logging was silenced.
                if "recompile limit" in (entry.fail_reason or ""):
                    with self._lock:
                        logged = self._limit_hits_logged > 0
                        self._limit_hits_logged -= int(logged)
                    if not logged:
                        self._fallback(EagerFallback(UNKNOWN, _code(entry), f"recompile limit hit: {reason}"))
                continue
            label, layout = joined
            with self._lock:
                self._count(self.threads[label], code=_code(entry), layout=layout, reason=reason)
            if (entry.co_filename, entry.co_firstlineno) in self.watch and not entry.graph_op_count:
                self._fallback(
                    EagerFallback(
                        label,
                        _code(entry),
                        "compile(AC(block)) captured no graph: a graph break inside the traced checkpoint (e.g. a "
                        "nested FSDP unit's hooks) makes Dynamo skip the whole region; use compile.layout ac_outer",
                    )
                )

    def _count(self, counts: ThreadCounts, *, code: str, layout: str | None, reason: str) -> None:
        """One forward compile of ``code``: a first compile, a new layout's first compile, or a recompile."""
        counts.frames[code] += 1
        first_for_layout = (code, layout) not in self._frame_layouts
        self._frame_layouts.add((code, layout))
        if not reason:
            return
        if first_for_layout and layout is not None and not is_automatic_dynamic(reason):
            counts.layout_compiles += 1
            return
        counts.recompiles += 1
        counts.reasons[reason] += 1
        counts.dynamic_recompiles += int(is_automatic_dynamic(reason))

    # -- views ------------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, int]:
        """Cumulative counts for the per-step metrics line (fwd: training thread; bwd: every other thread)."""
        self.refresh()
        fwd, bwd = self.threads[FORWARD], self.threads[OTHER]
        return {
            "compiles_fwd": fwd.compiles,
            "compiles_bwd": bwd.compiles,
            "recompiles_fwd": fwd.recompiles,
            "recompiles_bwd": bwd.recompiles,
            "layout_compiles": fwd.layout_compiles + bwd.layout_compiles,
            "dynamic_recompiles": fwd.dynamic_recompiles + bwd.dynamic_recompiles,
            "graph_breaks": fwd.graph_breaks + bwd.graph_breaks,
            "bwd_graphs": fwd.backward_graphs + bwd.backward_graphs,
            "eager_fallbacks": len(self.fallbacks),
        }

    def metric_sources(self) -> dict[str, Callable[[], int]]:
        """For ``LoopOptions.metric_sources``: one callable per metric, sharing one refresh per step."""
        cache: dict[str, int] = {}
        names = list(self.metrics())

        def source(name: str) -> Callable[[], int]:
            def read() -> int:
                if name == names[0] or not cache:
                    cache.clear()
                    cache.update(self.metrics())
                return cache[name]

            return read

        return {name: source(name) for name in names}

    def summary(self, *, top: int = 5) -> dict[str, Any]:
        """Totals plus the most frequent recompile reasons per thread and every eager fallback (JSON-able)."""
        result: dict[str, Any] = dict(self.metrics())
        for label, counts in self.threads.items():
            if counts.reasons:
                result[f"recompile_reasons_{label}"] = dict(counts.reasons.most_common(top))
            if label == OTHER and counts.frames:
                result[f"compiled_frames_{label}"] = dict(counts.frames.most_common(top))
        if self.fallbacks:
            result["eager_fallback_sites"] = [f"{f.thread}: {f.code}: {f.reason}" for f in self.fallbacks]
        return result

    def report(self) -> str:
        """A few human-readable lines for the end of a run."""
        m = self.metrics()
        lines = [
            f"compile | fwd thread: {m['compiles_fwd']} compiles ({m['recompiles_fwd']} recompiles) | "
            f"bwd thread(s): {m['compiles_bwd']} compiles ({m['recompiles_bwd']} recompiles) | "
            f"{m['layout_compiles']} new-layout compiles | {m['bwd_graphs']} backward graphs | "
            f"{m['graph_breaks']} graph breaks | {m['eager_fallbacks']} eager fallbacks"
        ]
        if m["dynamic_recompiles"]:
            lines.append(
                f"compile | FAILURE: {m['dynamic_recompiles']} automatic-dynamic recompiles (a size that varies per "
                "step was compiled static first; declare it in nemo_ac.workarounds.dynamic_per_batch_ints)"
            )
        for label, counts in self.threads.items():
            for reason, count in counts.reasons.most_common(3):
                lines.append(f"compile | {label} recompile x{count}: {reason}")
        for frame, count in self.threads[OTHER].frames.most_common(3):
            lines.append(f"compile | compiled on a bwd thread x{count}: {frame}")
        lines.extend(f.message() for f in self.fallbacks)
        return "\n".join(lines)


def _code(entry: Any) -> str:
    return f"'{entry.co_name}' ({entry.co_filename}:{entry.co_firstlineno})"
