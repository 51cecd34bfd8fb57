"""Checks of the private torch techniques nemo_ac relies on: is each API still there, and does it behave as relied on?

The probes (``runner.PROBES``) run a torch failure with and without its workaround. A technique row of the registry
(``workarounds.registry.TECHNIQUES``) has no failure of its own: it is a private torch API nemo_ac stands on, so a
torch release that moves or changes it breaks nemo_ac quietly (a compile report that counts nothing, a plan that no
longer sees a Dynamo-disabled module) or loudly at an unexpected place. Each check here calls the row's function in
``nemo_ac.workarounds`` on the installed torch, in the doctor's isolation (a private ``SAC_IGNORED_OPS``, a fresh
Dynamo), and either returns what it saw or raises. Cheap: all of them together run in about a second on CPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from nemo_ac.doctor.isolation import fresh_dynamo, private_sac_ignored_ops
from nemo_ac.workarounds import dynamo_compile_events as events
from nemo_ac.workarounds import fake_world
from nemo_ac.workarounds import node_shared_compile as node_shared
from nemo_ac.workarounds import shared_group_names as shared_names
from nemo_ac.workarounds.autograd_inside_op import autograd_inside_op
from nemo_ac.workarounds.dynamo_disable_marker import is_dynamo_disabled
from nemo_ac.workarounds.dynamo_settings import dynamo_setting, dynamo_settings_patched
from nemo_ac.workarounds.mem_tracker_global_peak import mem_tracker_internals_missing
from nemo_ac.workarounds.partitioner_op_list import compute_intensive_ops
from nemo_ac.workarounds.sac_mode_passthrough import is_passthrough_mode, is_torch_sac_mode, passthrough_sac_modes

Facts = dict[str, Any]


def check_sac_mode_passthrough() -> Facts:
    """torch's SAC modes re-classed: still torch's modes, the predicate is asked per op, gradients as without AC."""
    asked: list[str] = []

    def passes_through(func: Any) -> bool:
        asked.append(str(func))
        return func is torch.ops.aten.cos.default

    def context_fn() -> tuple[Any, Any]:
        return passthrough_sac_modes(
            lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE, passes_through=passes_through
        )

    caching, cached = context_fn()
    if not (is_torch_sac_mode(caching) and is_passthrough_mode(caching) and is_passthrough_mode(cached)):
        raise AssertionError(f"the re-classed modes are {type(caching).__name__} / {type(cached).__name__}")
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    (expected,) = torch.autograd.grad(x.sin().cos().sum(), x)
    out = checkpoint(lambda t: t.sin().cos(), x, use_reentrant=False, context_fn=context_fn)
    (got,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(got, expected)
    if not any("aten.cos" in name for name in asked):
        raise AssertionError("the pass-through predicate was never asked about the region's ops")
    return {"ops_asked": len(asked), "modes": type(caching).__name__}


@functools.cache
def _grad_of_sin_op() -> Any:
    """A custom op whose body runs autograd (as the mixer kernels' backward ops do), defined once per process."""

    @torch.library.custom_op("nemo_ac_doctor::grad_of_sin", mutates_args=())
    def grad_of_sin(x: torch.Tensor, lift: bool) -> torch.Tensor:
        leaf = x.detach().requires_grad_()
        with autograd_inside_op() if lift else torch.enable_grad():
            (grad,) = torch.autograd.grad(leaf.sin().sum(), leaf)
        return grad

    grad_of_sin.register_fake(lambda x, lift: torch.empty_like(x))
    grad_of_sin.register_autograd(lambda ctx, grad: (grad, None))
    return grad_of_sin


def check_autograd_inside_op() -> Facts:
    """Inside a custom op's body, autograd records nothing under ``enable_grad`` alone, and does with the lift."""
    op = _grad_of_sin_op()
    x = torch.randn(4, requires_grad=True)
    facts: Facts = {}
    try:
        op(x, False)
        facts["without"] = "autograd recorded (the lift is not needed on this torch)"
    except RuntimeError as exc:
        facts["without"] = str(exc).splitlines()[0]
    torch.testing.assert_close(op(x, True), x.detach().cos())
    facts["with"] = "gradient matches cos(x)"
    return facts


@torch.compiler.disable
def _breaks_the_graph(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def check_dynamo_compile_events() -> Facts:
    """The start / end callbacks fire around a compile, the graph-break counter and the compile metrics grow."""
    started: list[Any] = []
    ended: list[Any] = []
    handler = events.add_compile_callbacks(started.append, ended.append)
    if handler is None:
        raise AssertionError("torch._dynamo.callback_handler is missing or has no register_start_callback")
    # Dynamo keeps the metrics in a bounded deque: in a process that already compiled its maximum, the length stays put
    # while records rotate, so count the records that were not there before (held, so their ids stay unique).
    breaks_before, metrics_before = events.graph_break_total(), events.compilation_metrics()
    seen = {id(record) for record in metrics_before}
    try:
        compiled = torch.compile(lambda t: _breaks_the_graph(t.sin()).cos(), backend="eager")
        compiled(torch.randn(3))
    finally:
        events.remove_compile_callbacks(handler, started.append, ended.append)
    facts = {
        "starts": len(started),
        "ends": len(ended),
        "graph_breaks": events.graph_break_total() - breaks_before,
        "metrics": sum(id(record) not in seen for record in events.compilation_metrics()),
    }
    if not (facts["starts"] and facts["starts"] == facts["ends"] and facts["graph_breaks"] and facts["metrics"]):
        raise AssertionError(f"expected matching start/end callbacks, a graph break and compile metrics: {facts}")
    if not hasattr(started[0], "compile_id"):
        raise AssertionError("the callback arguments carry no compile_id")
    return facts


def check_dynamo_settings() -> Facts:
    """Both settings exist, a patch changes them on this thread only for its scope."""
    before = {key: dynamo_setting(key) for key in ("recompile_limit", "capture_scalar_outputs")}
    changed = {
        "recompile_limit": before["recompile_limit"] + 1,
        "capture_scalar_outputs": not before["capture_scalar_outputs"],
    }
    with dynamo_settings_patched(changed):
        inside = {key: dynamo_setting(key) for key in changed}
    after = {key: dynamo_setting(key) for key in changed}
    if inside != changed or after != before:
        raise AssertionError(f"patched {changed}, read {inside} inside and {after} after (before: {before})")
    return {"defaults": before}


def check_dynamo_disable_marker() -> Facts:
    """``torch.compiler.disable`` still leaves the marker, a plain function does not carry it."""

    def plain(x: torch.Tensor) -> torch.Tensor:
        return x

    if not is_dynamo_disabled(torch.compiler.disable(plain)) or is_dynamo_disabled(plain):
        raise AssertionError("the _torchdynamo_disable marker no longer tells disabled functions apart")
    return {"marker": "present"}


def check_partitioner_op_list() -> Facts:
    """The partitioner's compute-intensive list exists and holds the matmuls."""
    ops = compute_intensive_ops()
    if torch.ops.aten.mm not in ops:
        raise AssertionError(f"aten.mm is not among the {len(ops)} compute-intensive ops torch lists")
    return {"compute_intensive_ops": len(ops)}


def check_fake_world() -> Facts:
    """Fake tensors, the graph-task id inside and outside backward, a process group by name, DTensor's propagator."""
    with fake_world.fake_tensor_mode():
        fake = torch.empty(2, 3)
    if not fake_world.is_fake(fake):
        raise AssertionError("FakeTensorMode made a real tensor")
    seen: list[bool] = []
    x = torch.randn(3, requires_grad=True)
    x.register_hook(lambda grad: seen.append(fake_world.in_backward()))
    x.sum().backward()
    if fake_world.in_backward() or seen != [True]:
        raise AssertionError(f"in_backward() outside: {fake_world.in_backward()}, inside a backward hook: {seen}")
    numbers: list[int | None] = []
    y = x * 2
    y.grad_fn.register_prehook(lambda grads: numbers.append(fake_world.running_autograd_sequence_nr()))
    y.sum().backward()
    if numbers != [fake_world.autograd_sequence_nr(y.grad_fn)] or numbers[0] is None:
        raise AssertionError(f"the running node's sequence number {numbers} is not its grad_fn's")
    facts: Facts = {"graph_task_id": "tells backward apart", "autograd_node": "numbered"}
    if dist.is_initialized():
        world = dist.group.WORLD
        if fake_world.process_group_of(world.group_name) is not world:
            raise AssertionError("a functional collective's group name no longer resolves to its process group")
        facts["process_group_by_name"] = "resolves"
    with fake_world.dtensor_propagation_marked():
        pass
    fake_world.clear_dtensor_caches()
    return facts


def check_node_shared_compile() -> Facts:
    """inductor's entry points take the arguments the backend passes, the cache dir resolves, a held node lock
    excludes a second holder (another open file, as another rank's), and the cache counters read."""
    if not node_shared.available():
        raise AssertionError("torch._inductor.compile_fx.compile_fx no longer takes inner_compile / config_patches")
    cache = node_shared.inductor_cache_dir()
    with tempfile.TemporaryDirectory() as directory:
        with node_shared.node_lock("doctor", directory=Path(directory)):
            with node_shared.node_lock("doctor", directory=Path(directory)):  # re-entrant on this thread
                pass
            excluded = not _lock_free(Path(directory) / node_shared.LOCK_DIR / "doctor.lock")
        free_after = _lock_free(Path(directory) / node_shared.LOCK_DIR / "doctor.lock")
    if not (excluded and free_after):
        raise AssertionError(f"flock does not exclude a second holder here (held: {excluded}, freed: {free_after})")
    if node_shared.NodeSharedInductor({"a": 1}) != node_shared.NodeSharedInductor({"a": 1}):
        raise AssertionError("equal backends compare unequal: every block would compile its own graph")
    return {"cache_dir": str(cache), "counters": node_shared.compile_cache_counts()}


def check_shared_group_names() -> Facts:
    """Two groups over the same ranks (this process's world of one rank, else a fake world of two): one registered
    under its role's name resolves by it (what compiled code does), a traced functional collective carries that name,
    and the other group does not take the name over."""
    if not shared_names.available():
        raise AssertionError("torch no longer registers / resolves a process group under a second name")
    if dist.is_initialized() and dist.get_world_size() > 1:
        return {"skipped": "needs every rank to create groups; run in a process of its own"}
    world = contextlib.nullcontext() if dist.is_initialized() else fake_world.fake_process_group(rank=0, world_size=2)
    with world:
        ranks = list(range(dist.get_world_size()))
        first, second = dist.new_group(ranks), dist.new_group(ranks)
        try:
            facts = _shared_group_name_facts(first, second)
        finally:
            shared_names.release_shared_group_name(role="doctor")
    return facts


def _shared_group_name_facts(first: dist.ProcessGroup, second: dist.ProcessGroup) -> Facts:
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    name = shared_names.shared_group_name(first, role="doctor")
    if name != shared_names.PREFIX + "doctor" or shared_names.shared_group_name(first, role="doctor") != name:
        raise AssertionError(f"the role's name was not registered for the group (got {name!r})")
    if fake_world.process_group_of(name) != first:
        raise AssertionError(f"{name!r} does not resolve to the group it was registered for")
    if shared_names.shared_group_name(second, role="doctor") is not second:
        raise AssertionError("a second group took over a name another group of this process holds")
    graph = make_fx(lambda x: funcol.all_to_all_single(x, None, None, name) * 1)(
        torch.ones(2 * len(dist.get_process_group_ranks(first)))
    )
    if repr(name) not in graph.code or repr(first.group_name) in graph.code:
        raise AssertionError(f"the traced collective does not address the group by {name!r}:\n{graph.code}")
    return {"name": name, "own_name": first.group_name, "traced": "the collective carries the shared name"}


def _lock_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def check_mem_tracker_global_peak() -> Facts:
    """The private method the tracker overrides and the private state it reads are where it expects them."""
    missing = mem_tracker_internals_missing()
    if missing:
        raise AssertionError(f"torch's memory tracker no longer has {missing}")
    return {"overrides": "_update_peak_stats"}


@dataclass(frozen=True)
class CheckSpec:
    """One technique check: ``row`` names the registry row (and so the module) it checks."""

    row: str
    title: str
    run: Callable[[], Facts]


CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec(
        "sac_mode_passthrough", "re-classed SAC modes run a region with torch's gradients", check_sac_mode_passthrough
    ),
    CheckSpec("autograd_inside_op", "autograd inside a custom op's body", check_autograd_inside_op),
    CheckSpec("dynamo_compile_events", "Dynamo's compile callbacks, counters and metrics", check_dynamo_compile_events),
    CheckSpec("dynamo_settings", "recompile_limit / capture_scalar_outputs patched per thread", check_dynamo_settings),
    CheckSpec("dynamo_disable_marker", "torch.compiler.disable's marker", check_dynamo_disable_marker),
    CheckSpec("partitioner_op_list", "the partitioner's compute-intensive ops", check_partitioner_op_list),
    CheckSpec("fake_world", "fake tensors, graph-task id, groups by name", check_fake_world),
    CheckSpec("node_shared_compile", "inductor compiles under a node lock, cache counters", check_node_shared_compile),
    CheckSpec("shared_group_names", "a process group under a second, per-role name", check_shared_group_names),
    CheckSpec("mem_tracker_global_peak", "the memory tracker's peak update and state", check_mem_tracker_global_peak),
)


@dataclass
class CheckResult:
    """One technique check's outcome: ``ok`` with what it saw, or the error that broke it."""

    row: str
    title: str
    ok: bool
    facts: Facts = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_check(spec: CheckSpec) -> CheckResult:
    """Run one check in the doctor's isolation; an exception is the result, never raised."""
    start = time.perf_counter()
    result = CheckResult(row=spec.row, title=spec.title, ok=False)
    try:
        with private_sac_ignored_ops(upstream_only=False), fresh_dynamo():
            result.facts = spec.run()
        result.ok = True
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        result.facts["traceback"] = traceback.format_exc(limit=-2)[-800:]
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def run_checks() -> list[CheckResult]:
    return [run_check(spec) for spec in CHECKS]
