"""One inductor compile per graph per node: the ranks of a node take turns at each compile, the first compiles and the
others load its artifacts from inductor's on-disk caches.

Cost prevented (no error): every rank of a node compiles the same decoder-block graphs at the same time. Ranks run
in lockstep (the forward holds collectives), so all of them reach each compile together, each misses inductor's FX
graph cache (the artifact is written only when a compile ends) and each runs the full compile: ``make run``'s 4
ranks on 2 cores do 4x the work of one compile, contending for the cores.

Fix: inductor's compile of each graph (``compile_fx_inner``: the FX graph cache lookup, and on a miss lowering,
code generation and the C++ build) is held under a node-local file lock (``fcntl.flock``) named by the graph, a file
in inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, else ``/tmp/torchinductor_$USER``: what every rank of a
node shares, and what makes the artifacts loadable at all). The first rank to take the lock compiles and writes the
artifact; each other rank, once it holds the lock, finds it (an FX graph cache hit) and loads it instead of
compiling. The backend is ``compile_fx(gm, example_inputs, inner_compile=<locked compile_fx_inner>,
config_patches=options)``, what ``backend="inductor"`` calls, so the lock covers the forward graph, the backward
graph AOTAutograd compiles at once and the one it compiles lazily at the first backward (symbolic sizes saved for
backward) alike. AOTAutograd's tracing stays outside the lock: every rank traces concurrently, and holding the lock
over it would make each rank trace after the previous one's compile (AOTAutograd's own cache rarely spares that
trace here: with a lazily compiled backward its entry is written only once the backward compiled).

The lock is per graph (a hash of the graph's code and its inputs' shapes, dtypes and strides), so ranks compiling
different graphs (rank-specific graphs: a CP rank's head slice, a DTensor's mesh; ``shared_group_names`` keeps the
process group's name out of them) still compile in
parallel; a thread already holding a lock takes it again without waiting. Once a compile of a graph finished, a
``.done`` marker next to its lock lets later compiles of it (a warm run: every rank hits the cache) skip the lock
instead of loading one rank at a time. The lock and the marker only order compiles: the caches decide what is
loaded, so a stale marker (a cache cleared by hand, other inductor options) only brings back concurrent compiles. No collective runs while a lock is held: inductor's compile lowers and generates code for a graph
(functional collectives in it are nodes, not calls) and the lock is released before the compiled graph first
executes; Dynamo's compile-time collectives (``enable_compiler_collectives``, off by default) run while Dynamo
traces, before the backend is called. A rank waiting on the lock waits only on a compile that needs no other rank,
so its wait is bounded by one compile (plus the loads of the ranks queued before it).

Where it pays: ranks outnumbering the cores they can compile on (``make run``: 4 ranks on 2 cores; a loaded host);
with a free core per rank the concurrent compiles took about as long as one, and the lock adds the loads.

Read through here too: inductor's FX graph cache and AOTAutograd cache hit / miss counters
(``torch._dynamo.utils.counters``), for the compile summary's per-rank line.

Relies on: torch._inductor.compile_fx.compile_fx (its inner_compile and config_patches arguments), compile_fx_inner,
torch._inductor.runtime.cache_dir_utils.cache_dir and the fxgraph_cache_hit / fxgraph_cache_miss counters.
Torch versions: checked on 2.13.0 (``nemo-ac doctor`` check ``node_shared_compile``); where a piece is missing the
backend is plain ``"inductor"`` (every rank compiles, as before).
Upstream: none filed (torch's remote caches and ``torch.compiler.save_cache_artifacts`` share artifacts between
runs, not between the concurrent ranks of one run).
Delete when: inductor serializes identical concurrent compiles on a node itself (a torch option that takes a lock
around FxGraphCache's miss path), or Dynamo shares one rank's compile with the others of a node.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

LOCK_DIR = "nemo_ac_compile_locks"  # inside inductor's cache directory

_held = threading.local()  # lock names this thread holds (nested locks do not wait)


def inductor_cache_dir() -> Path:
    """The directory inductor's on-disk caches live in (and the ranks of a node share)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


@contextlib.contextmanager
def node_lock(name: str, *, directory: Path | None = None) -> Iterator[None]:
    """Hold the node-wide exclusive lock ``name`` (a file under ``directory``, default inductor's cache dir).

    Blocks while another process (or thread) holds it; re-entrant on the thread already holding it. ``flock`` locks
    die with their process, so a rank killed mid-compile frees the lock."""
    folder = (directory if directory is not None else inductor_cache_dir()) / LOCK_DIR
    path = folder / f"{name}.lock"
    held: set[Path] = _held.__dict__.setdefault("paths", set())
    if path in held:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.add(path)
        try:
            yield
        finally:
            held.discard(path)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def graph_lock_name(gm: Any, example_inputs: Any) -> str:
    """A name for one graph: its code and its inputs' shapes, dtypes and strides. Equal graphs on two ranks get one
    name; a collision only makes two compiles take turns (the caches, not this name, decide what is loaded)."""
    parts = [str(getattr(gm, "code", type(gm).__name__))]
    for value in example_inputs:
        shape = getattr(value, "shape", None)
        if shape is None:
            parts.append(repr(value))
            continue
        stride = value.stride() if hasattr(value, "stride") else ()
        parts.append(f"{tuple(shape)}|{getattr(value, 'dtype', '')}|{tuple(stride)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _locked_inner_compile(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
    """``compile_fx_inner`` under the graph's node lock, unless a compile of this graph already finished on this node
    (its ``.done`` marker): then the cache holds it and the ranks load it without taking turns (a warm run)."""
    from torch._inductor.compile_fx import compile_fx_inner

    name = graph_lock_name(gm, example_inputs)
    done = inductor_cache_dir() / LOCK_DIR / f"{name}.done"
    if done.exists():
        return compile_fx_inner(gm, example_inputs, **kwargs)
    with node_lock(name):
        result = compile_fx_inner(gm, example_inputs, **kwargs)
        done.touch()
    return result


class NodeSharedInductor:
    """A ``torch.compile`` backend: inductor with each graph's compile under its node lock. Instances with equal
    options are equal (Dynamo's backend-match guard: blocks sharing one code object keep sharing one graph)."""

    compiler_name = "inductor"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = dict(options or {})
        self.__name__ = "inductor_node_shared"

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=_locked_inner_compile, config_patches=self.options or None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeSharedInductor) and self.options == other.options

    def __hash__(self) -> int:
        return hash(tuple(sorted((key, repr(value)) for key, value in self.options.items())))


def available() -> bool:
    """Whether this torch has the private pieces (else the backend stays plain inductor)."""
    try:
        import inspect

        from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: F401
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # noqa: F401

        parameters = inspect.signature(compile_fx).parameters
    except (ImportError, TypeError, ValueError):
        return False
    return "inner_compile" in parameters and "config_patches" in parameters


def node_shared_compile_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` kwargs with ``backend="inductor"`` (and its ``options``) replaced by ``NodeSharedInductor``;
    other backends, or a torch without the pieces, are returned unchanged."""
    if kwargs.get("backend") != "inductor" or kwargs.get("mode") not in (None, "default") or not available():
        return kwargs
    rest = {key: value for key, value in kwargs.items() if key not in ("backend", "options")}
    return {**rest, "backend": NodeSharedInductor(kwargs.get("options"))}


CACHE_COUNTERS = {
    "fxgraph_hits": ("inductor", "fxgraph_cache_hit"),
    "fxgraph_misses": ("inductor", "fxgraph_cache_miss"),
    "aot_cache_hits": ("aot_autograd", "autograd_cache_hit"),
    "aot_cache_misses": ("aot_autograd", "autograd_cache_miss"),
}


def compile_cache_counts() -> dict[str, int]:
    """This process's inductor FX graph cache and AOTAutograd cache hits and misses so far (0 where missing)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return dict.fromkeys(CACHE_COUNTERS, 0)
    result = {}
    for name, (group, key) in CACHE_COUNTERS.items():
        try:
            result[name] = int(counters[group][key])
        except Exception:
            result[name] = 0
    return result
