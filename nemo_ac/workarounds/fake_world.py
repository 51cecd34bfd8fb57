"""The private torch a full-size dry run (``nemo_ac.simulate``) stands on: a fake process group, fake tensors,
real tensors among fake ones, the autograd graph task, and collective ops' process groups.

There is no error to prevent here: this is the one module where the dry run touches torch internals, each behind a
small function, so a torch release that moves one breaks this module's tests (``tests/unit/simulate``) and nothing
else. Checked on torch 2.13.0 and 2.14.1 (CI), where each of them is present as used:

- ``dist.init_process_group("fake", ...)``: the ``fake`` backend is registered by torch itself
  (``torch/testing/_internal/distributed/fake_pg.py``, ``FakeProcessGroup`` in C++; the backend name exists since
  2.7). Every collective returns at once and moves nothing: one rank of a 64-rank layout runs in one process.
- ``torch._subclasses.fake_tensor.FakeTensorMode`` / ``unset_fake_temporarily``: tensors with shapes, dtypes and
  devices but no storage (torchtitan's memory estimation runs the same way).
- ``torch.utils._python_dispatch._disable_current_modes``: a FLOP formula that runs nemo_ac's torch reference of a
  GPU kernel (``models.kernels.op_flops.reference_flops``) does so with the surrounding modes popped.
- ``torch._C._current_graph_task_id``: -1 outside backward (what ``torch.utils.checkpoint`` asks too): tells the
  dry run's counters forward, backward and recompute apart.
- ``torch._C._current_autograd_node`` and ``Node._sequence_nr``: the autograd node the engine is running and its
  creation number (per thread, increasing: what the profiler's ``seq`` is). The estimate attributes a backward op to
  the compiled block whose forward created that node (``simulate.fusion``).
- ``torch.distributed.distributed_c10d._resolve_process_group`` and ``ProcessGroup.unbox``: the process group of a
  functional / c10d collective op, to attribute its bytes to a mesh dimension.
- ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` (the Python and the C++ fast-path caches) and the
  propagator's tensor-meta cache, cleared around each fake process group (``clear_dtensor_caches``).
- ``ShardingPropagator._propagate_tensor_meta_non_cached`` (``torch/distributed/tensor/_sharding_prop.py``): DTensor
  derives an op's output metadata by running it on fake tensors of the GLOBAL shape, under the ambient fake mode
  when there is one (``detect_fake_mode()``). Counted, those ops are allocations and FLOPs that never happen: a
  dry run of the GLM-4.5-Air recipe showed a 23 GiB "peak" in the optimizer step, the global-shape copies of every
  gradient ``_foreach_norm`` was propagated over (torch's ``MemTracker`` skips them only when the propagation's fake
  mode differs from the one it entered under). ``dtensor_propagation_marked`` wraps that method so that
  ``in_sharding_propagation()`` tells the counters to let those ops pass uncounted.

Relies on: torch._subclasses.fake_tensor, torch._C._current_graph_task_id, torch._C._current_autograd_node,
torch.distributed.distributed_c10d._resolve_process_group and DTensor's sharding propagator (the pieces above).
``nemo-ac doctor`` (check ``fake_world``) asks the installed torch for each of them.
Upstream: none filed.
Delete when: torch has public equivalents (a documented fake world for estimation, torch.distributed._tools being
promoted); until then each helper is one place to repair.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FAKE_BACKEND = "fake"


@contextlib.contextmanager
def fake_process_group(*, rank: int, world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` ranks in this process, as rank ``rank``, that communicates
    nothing; destroyed on exit. Refuses to replace a process group that is already up (a real run's)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process; the dry run needs its own")
    clear_dtensor_caches()
    dist.init_process_group(FAKE_BACKEND, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


def clear_dtensor_caches() -> None:
    """Forget DTensor's sharding-propagation caches. They are keyed by specs whose meshes compare by value, so after
    a process group is destroyed and another made, a cached result hands back the old mesh, whose group names no
    longer resolve (the second dry run of the same layout in one process failed with ``Could not resolve the process
    group registered under the name 11``)."""
    from torch.distributed.tensor import debug

    clear_both = getattr(debug, "_clear_sharding_prop_cache", None)  # the Python and the C++ fast-path caches
    if clear_both is not None:
        clear_both()
    propagator = DTensor._op_dispatcher.sharding_propagator
    clear = getattr(propagator._propagate_tensor_meta_cached, "cache_clear", None)
    if clear is not None:
        clear()


@contextlib.contextmanager
def isolated_fake_mode() -> Iterator[None]:
    """A fresh FakeTensorMode with every active dispatch mode popped for the duration (``_disable_current_modes``):
    a FLOP formula that runs a reference computation from inside another mode's dispatch counts only itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), FakeTensorMode():
        yield


def fake_tensor_mode() -> Any:
    """A FakeTensorMode in which real tensors (the batch's ids) may meet fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class RealWhereAllReal(TorchDispatchMode):
    """Above a FakeTensorMode: an op whose tensor inputs are all real runs for real, outside the fake mode.

    The batch (token ids, document ids, positions, image grids) stays real in a dry run, so everything the model
    derives from it on the host (image placeholder counts, M-RoPE positions, document boundaries, the visible pairs
    attention counts) has values, while weights and activations stay fake. Of the ops without tensor inputs
    (factories) only ``arange`` runs for real (the positions and indices the model makes next to the batch's ids);
    every other factory stays fake: a parameter or an activation never becomes real."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        if in_sharding_propagation():
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor desugars into local ops first, which come back here
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten.arange:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def autograd_sequence_nr(node: Any) -> int | None:
    """The creation number of an autograd node (``tensor.grad_fn``), None for no node or a leaf's accumulator (which
    carries the maximum value: it belongs to no forward op)."""
    if node is None:
        return None
    number = int(node._sequence_nr())
    return None if number >= 2**63 - 1 or number < 0 else number


def running_autograd_sequence_nr() -> int | None:
    """The creation number of the node autograd's engine is running on this thread (None outside backward)."""
    return autograd_sequence_nr(torch._C._current_autograd_node())


def process_group_of(group: Any) -> dist.ProcessGroup | None:
    """The ProcessGroup a collective op names: a c10d op's boxed group or a functional op's group name."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    if isinstance(group, dist.ProcessGroup):
        return group
    try:
        return dist.ProcessGroup.unbox(group)
    except (RuntimeError, TypeError, AttributeError):
        return None


_PROPAGATION = threading.local()


def in_sharding_propagation() -> bool:
    """Whether DTensor is deriving output metadata on global-shape fake tensors right now (module docstring)."""
    return getattr(_PROPAGATION, "depth", 0) > 0


@contextlib.contextmanager
def dtensor_propagation_marked() -> Iterator[None]:
    """While active, ``in_sharding_propagation()`` is True inside DTensor's metadata propagation; restored on exit."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    @functools.wraps(original)
    def marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        _PROPAGATION.depth = getattr(_PROPAGATION, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _PROPAGATION.depth -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = marked  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]
