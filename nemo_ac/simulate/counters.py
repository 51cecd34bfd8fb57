"""What one training step executes, op by op: FLOPs, memory traffic and collective bytes, in one dispatch mode.

``StepCounter`` sees every op the step dispatches (real or fake tensors alike) and records:

- FLOPs from torch's own formula registry (``torch.utils.flop_counter.flop_registry``: what ``FlopCounterMode``
  counts, nemo_ac's custom ops included via ``nemo_ac.models.kernels.op_flops``), split by phase: forward, backward,
  recompute (a checkpointed forward op run again in backward) and optimizer;
- bytes read and written (input and output storages, views and no-compute ops excluded) for the roofline;
- collectives: op, process group (labelled by mesh dimension), payload bytes and the bytes this rank puts on the
  wire under the ring model (all-gather / reduce-scatter ``(n-1)/n`` of the full buffer, all-reduce twice that,
  all-to-all what goes to the other ranks, point-to-point what is sent);
- the ops with no FLOP formula that may compute (named in the report, never counted as 0 silently).

The same mode counts a real gloo run (the accuracy tests) and a fake-world dry run, so the two are compared op for
op rather than through two counting methods.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from nemo_ac.distributed.expert_parallel import deepep_ops
from nemo_ac.distributed.offload import copying_on_compute_stream
from nemo_ac.models.kernels.op_flops import needs_formula
from nemo_ac.simulate.fusion import CompiledRegions, is_extern
from nemo_ac.simulate.gpus import GPUS_PER_NODE
from nemo_ac.simulate.op_cost import OpCost
from nemo_ac.simulate.routing import DeepEPRouting
from nemo_ac.workarounds.fake_world import in_backward, in_sharding_propagation, process_group_of

PHASES = ("forward", "backward", "recompute", "optimizer")
WORLD = "world"  # the label of the default process group (the loop's loss and expert-load all-reduces)

_c10d = torch.ops.c10d
_fc = torch.ops._c10d_functional
_fca = torch.ops._c10d_functional_autograd

# Collectives nemo_ac's step issues: op -> (kind, index of the process group argument).
_COLLECTIVES: dict[Any, tuple[str, int | str]] = {
    _c10d._allgather_base_.default: ("all_gather", 2),
    _c10d.allgather_.default: ("all_gather", 2),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 2),
    _c10d.reduce_scatter_.default: ("reduce_scatter", 2),
    _c10d.allreduce_.default: ("all_reduce", 1),
    _c10d.alltoall_base_.default: ("all_to_all", 2),
    _c10d.broadcast_.default: ("broadcast", 1),
    _c10d.send.default: ("send", 1),
    _c10d.recv_.default: ("recv", 1),
    _fc.all_gather_into_tensor.default: ("all_gather", 2),
    _fca.all_gather_into_tensor.default: ("all_gather", 2),
    _fc.reduce_scatter_tensor.default: ("reduce_scatter", 3),
    _fca.reduce_scatter_tensor.default: ("reduce_scatter", 3),
    _fc.all_reduce.default: ("all_reduce", 2),
    _fc.all_to_all_single.default: ("all_to_all", 3),
    _fca.all_to_all_single.default: ("all_to_all", 3),
    _fc.broadcast.default: ("broadcast", 2),
}
_NO_TRAFFIC = frozenset({_fc.wait_tensor.default, _c10d.barrier.default})
# Ops that compute nothing and move nothing worth counting for the roofline (metadata, allocation, views).
_FREE_PACKETS = frozenset(
    {
        "detach",
        "view",
        "_unsafe_view",
        "reshape",
        "expand",
        "t",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "unbind",
        "alias",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "lift_fresh",
        "_to_copy_meta",
        "set_",
        "resize_",
        "record_stream",
        "_local_scalar_dense",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "is_same_size",
    }
)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _written_bytes(func: Any, args: Any, kwargs: dict) -> int:
    """Bytes an op returning nothing writes into its arguments (the schema's ``Tensor(a!)`` ones): fused and foreach
    optimizer updates (``_fused_adamw_``, ``_foreach_mul_``) and FSDP2's copy-out (``split_with_sizes_copy(out=)``),
    whose traffic a count of outputs alone would miss. The schema's marks are an upper bound where a kernel writes
    conditionally (``_fused_adamw_`` marks its gradients written, for unscaling under a grad scaler)."""
    schema = getattr(func, "_schema", None)
    total = 0
    for index, argument in enumerate(getattr(schema, "arguments", ())):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        total += sum(_nbytes(t) for t in _tensors(value))
    return total


def _row_bytes(*tensors: torch.Tensor) -> int:
    return sum(_nbytes(t) // max(t.shape[0], 1) for t in tensors)


# DeepEP's ops (distributed.expert_parallel.deepep_ops) -> (this rank's tokens, bytes per token sent, buffers key),
# read from each op's arguments.
_DEEPEP_SENDS: dict[str, Callable[[tuple], tuple[int, int, int]]] = {
    "deepep_dispatch": lambda a: (a[0].shape[0], _row_bytes(a[0], a[1], a[2]), a[3]),  # x, topk ids, topk weights
    "deepep_combine_backward": lambda a: (a[0].shape[0], _row_bytes(a[0]), a[2]),  # a dispatch of the gradient
    "deepep_combine": lambda a: (a[3], _row_bytes(a[0]), a[2]),  # [received, H] back to the num_tokens sources
    "deepep_dispatch_backward": lambda a: (a[4], _row_bytes(a[0], a[1]), a[3]),  # a combine: gradients, weights'
}
# The asynchronous backward (deepep_ops, "Asynchronous backward"): a start op issues the transfer of the op named
# here, the finish op is where its outputs arrive (or, with no start before it, the transfer itself).
_DEEPEP_STARTS = {
    "deepep_dispatch_backward_start": "deepep_dispatch_backward",
    "deepep_combine_backward_start": "deepep_combine_backward",
}
_DEEPEP_FINISHES = {
    "deepep_dispatch_backward_finish": "deepep_dispatch_backward",
    "deepep_combine_backward_finish": "deepep_combine_backward",
}
_DEEPEP_OPS = frozenset(_DEEPEP_SENDS) | frozenset(_DEEPEP_STARTS) | frozenset(_DEEPEP_FINISHES)


# The dry run keeps what a GPU run holds in host memory (offloaded activations, offloaded optimizer states) on the
# "meta" device, so that it leaves the device's accounting; a copy between it and the device is host-link traffic.
_HOST_STAND_IN = "meta"
_COPY_PACKETS = frozenset({"copy_", "_to_copy", "copy"})


def _host_link_payload(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """Bytes a copy moves between the device and the host stand-in; 0 for any other op."""
    if name not in _COPY_PACKETS or not outputs:
        return 0
    devices = {t.device.type for t in (*inputs, *outputs)}
    if _HOST_STAND_IN not in devices or len(devices) < 2:
        return 0
    return _nbytes(outputs[0])


@dataclass
class CollectiveRecord:
    """Collectives of one (mesh dimension, op, overlapped) key over the counted step. ``overlapped``: issued by
    FSDP2 on its own stream (c10d all-gather / reduce-scatter, and HSDP's all-reduce), which the estimate hides
    behind compute; the model's functional collectives (EP all-to-all, CP) and the loop's all-reduces block."""

    calls: int = 0
    payload_bytes: int = 0  # the full buffer of each call (all-gather output, reduce-scatter input, ...)
    wire_bytes: int = 0  # what this rank sends, ring model (DeepEP: over NVLink, one copy per destination rank)
    ranks: tuple[int, ...] = ()
    network_bytes: int = 0  # DeepEP only: what crosses to other nodes over RDMA (one copy per destination node)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective in issue order, for the trace: issued after ``at`` costs of its segment."""

    at: int
    label: str
    kind: str
    overlapped: bool
    phase: str
    wire_bytes: int
    network_bytes: int
    ranks: tuple[int, ...]
    weight: int = 1
    # An asynchronous call (DeepEP's transfers with ``async_finish``): the cost index of the first op that reads what
    # it received. The costs in between run while it is in flight; None: it blocks where it is issued.
    read_at: int | None = None


@dataclass
class StepCounts:
    flops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    costs: list[OpCost] = field(default_factory=list)
    collectives: dict[tuple[str, str, bool], CollectiveRecord] = field(default_factory=dict)
    without_formula: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ops: int = 0
    calls: list[CollectiveCall] = field(default_factory=list)  # every collective, in order (the trace)
    # Costs (and calls) from this index on are micro batches counted as the last one run, not run themselves.
    replayed_from: int | None = None

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    @property
    def model_flops(self) -> int:
        """Forward and backward, without the recompute and the optimizer: what MFU divides."""
        return self.flops["forward"] + self.flops["backward"]


class StepCounter(TorchDispatchMode):
    """The dispatch mode (see the module docstring). ``group_labels``: process group name -> mesh dimension label;
    ``phase("optimizer")`` marks the optimizer step (forward / backward / recompute are found by themselves)."""

    def __init__(
        self,
        *,
        group_labels: dict[str, str] | None = None,
        regions: CompiledRegions | None = None,
        deepep: DeepEPRouting | None = None,
    ) -> None:
        """The outputs of the model's functional collectives (EP all-to-all, CP exchanges) are kept as live
        "communication buffer" bytes (FSDP's own buffers the memory tracker names itself); ``buffer_state()``
        reports them with the phase. ``regions``: the plan's compiled blocks, whose fused traffic each op's
        ``compiled_bytes`` records (``simulate.fusion``). ``deepep``: how DeepEP's ops (``nemo_ac::deepep_*``) are
        costed, recorded as kind ``deepep`` with the copies DeepEP sends (``simulate.routing.deepep_destinations``)."""
        super().__init__()
        self.group_labels = dict(group_labels or {})
        self.regions = regions
        self.deepep = deepep
        self.counts = StepCounts()
        self.live_buffer_bytes = 0
        self.last_op = "no op yet"
        self.failed_op = ""  # the first op that raised: named by a failure report
        self.sequence = 0  # ops seen since the counter was made (never reset: orders costs and memory samples)
        self._buffers: dict[int, Any] = {}
        self._in_flight: dict[int, int] = {}  # storage id of an async call's output -> its index in counts.calls
        self._started: dict[str, list[int]] = {}  # a started backward transfer's op -> its calls not yet finished
        self._forced_phase: str | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self._forced_phase = self._forced_phase, name
        try:
            yield
        finally:
            self._forced_phase = previous

    def reset(self) -> None:
        if self.regions is not None:
            self.regions.finish()  # pending writes land on this segment's costs before it is handed on
        self.counts = StepCounts()
        self._in_flight.clear()
        self._started.clear()

    def _phase(self) -> str:
        if self._forced_phase is not None:
            return self._forced_phase
        if in_backward():
            return "recompute" if torch.is_grad_enabled() else "backward"
        return "forward"

    def _label(self, group: dist.ProcessGroup | None) -> tuple[str, tuple[int, ...]]:
        if group is None:
            return "unknown group", ()
        ranks = tuple(dist.get_process_group_ranks(group))
        name = getattr(group, "group_name", "")
        if name in self.group_labels:
            return self.group_labels[name], ranks
        return f"group of {len(ranks)} ranks", ranks

    def _count_collective(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        kind, group_at = _COLLECTIVES[func]
        group = process_group_of(args[group_at] if isinstance(group_at, int) and group_at < len(args) else None)
        label, ranks = self._label(group)
        n = max(len(ranks), 1)
        first = args[0]
        if kind == "all_gather":
            payload = sum(_nbytes(t) for t in _tensors(out if func in (_fc.all_gather_into_tensor.default,
                                                                       _fca.all_gather_into_tensor.default) else first))  # fmt: skip
            wire = payload * (n - 1) // n
        elif kind == "reduce_scatter":
            source = args[1] if func.namespace == "c10d" else first
            payload = sum(_nbytes(t) for t in _tensors(source))
            wire = payload * (n - 1) // n
        elif kind == "all_reduce":
            payload = sum(_nbytes(t) for t in _tensors(first))
            wire = 2 * payload * (n - 1) // n
        elif kind == "all_to_all":
            source = args[1] if func.namespace == "c10d" else first
            splits = args[4] if func.namespace == "c10d" else args[2]
            payload = _nbytes(source)
            row = payload // max(source.shape[0], 1) if source.dim() else 0
            mine = dist.get_rank(group) if group is not None else 0
            own = (splits[mine] if splits else source.shape[0] // n) * row
            wire = payload - own
        else:  # broadcast, send, recv: the buffer once
            payload = sum(_nbytes(t) for t in _tensors(first))
            wire = payload if kind != "recv" else 0
        overlapped = func.namespace == "c10d" and (
            kind in ("all_gather", "reduce_scatter") or (kind == "all_reduce" and WORLD not in label.split("/"))
        )
        self._record(label, kind, overlapped, ranks, payload, wire)
        if func.namespace != "c10d":  # the model's functional collectives (EP, CP); FSDP2's are c10d ops
            for tensor in _tensors(out):
                self._keep_buffer(tensor)

    def _count_deepep(self, name: str, args: tuple, out: Any) -> None:
        """One of DeepEP's ops: what this rank sends is its tokens, once per other rank each goes to over NVLink and
        once per other node over RDMA (a dispatch; a combine sends as many back, every rank routing alike), a row
        being the op's hidden row plus, for the dispatch, the token's expert ids and weights. A backward transfer
        started asynchronously is counted at its start and arrives at its finish (``CollectiveCall.read_at``)."""
        if name in _DEEPEP_FINISHES:
            name = _DEEPEP_FINISHES[name]
            started = self._started.get(name)
            if started:
                index = started.pop(0)
                self.counts.calls[index] = dataclasses.replace(self.counts.calls[index], read_at=len(self.counts.costs))
                for tensor in _tensors(out):
                    self._keep_buffer(tensor)
                return
        start = name in _DEEPEP_STARTS
        name = _DEEPEP_STARTS.get(name, name)
        tokens, rows, key = _DEEPEP_SENDS[name](args)
        group = deepep_ops.buffer_source(key).group
        label, ranks = self._label(group)
        if self.deepep is None:
            raise RuntimeError("a DeepEP op ran in a dry run whose plan has no DeepEP dispatcher")
        where = self.deepep.destinations(
            tokens=tokens, group_ranks=ranks, rank_in_group=dist.get_rank(group), gpus_per_node=GPUS_PER_NODE
        )
        payload = sum(_nbytes(t) for t in _tensors(out))
        if start:  # what the finish will return: [num_tokens, H] and the weights' [num_tokens, k], or [received, H]
            payload = args[4] * rows if name == "deepep_dispatch_backward" else args[3] * _row_bytes(args[0])
        wire = round(tokens * where.remote_ranks_per_token * rows)
        # The forward ops run inside their autograd function, without grad mode: seen during backward they are a
        # checkpoint's recompute, which the phase from grad mode cannot tell from the backward.
        forward_op = name in ("deepep_dispatch", "deepep_combine")
        phase = "recompute" if forward_op and self._phase() == "backward" else self._phase()
        with self.phase(phase):
            self._record(label, "deepep", False, ranks, payload, wire,
                         network=round(tokens * where.remote_nodes_per_token * rows))  # fmt: skip
        if start:
            self._started.setdefault(name, []).append(len(self.counts.calls) - 1)
        asynchronous = (name == "deepep_dispatch" and len(args) > 5 and bool(args[5])) or (
            name == "deepep_combine" and len(args) > 4 and bool(args[4])
        )
        for tensor in _tensors(out):
            if tensor.dim():  # not the handle token (a host scalar)
                self._keep_buffer(tensor)
            if asynchronous:
                self._in_flight[id(tensor.untyped_storage())] = len(self.counts.calls) - 1

    def _record(
        self,
        label: str,
        kind: str,
        overlapped: bool,
        ranks: tuple[int, ...],
        payload: int,
        wire: int,
        *,
        network: int = 0,
    ) -> None:
        record = self.counts.collectives.setdefault((label, kind, overlapped), CollectiveRecord(ranks=ranks))
        record.calls += 1
        record.payload_bytes += payload
        record.wire_bytes += wire
        record.network_bytes += network
        self.counts.calls.append(
            CollectiveCall(len(self.counts.costs), label, kind, overlapped, self._phase(), wire, network, ranks)
        )

    def _mark_first_read(self, inputs: list[torch.Tensor]) -> None:
        """An op reading an async call's output: the call's transfer ends before it (``CollectiveCall.read_at``)."""
        for tensor in inputs:
            index = self._in_flight.get(id(tensor.untyped_storage()))
            if index is None:
                continue
            call = self.counts.calls[index]
            self.counts.calls[index] = dataclasses.replace(call, read_at=len(self.counts.costs))
            self._in_flight = {key: i for key, i in self._in_flight.items() if i != index}

    def _keep_buffer(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as a live communication buffer until it is freed."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._buffers:
            return
        size = storage.nbytes()
        self.live_buffer_bytes += size

        def freed(key: int = key, size: int = size) -> None:
            self.live_buffer_bytes -= size
            self._buffers.pop(key, None)

        self._buffers[key] = weakref.finalize(storage, freed)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if in_sharding_propagation():  # DTensor's global-shape metadata ops: nothing runs (workarounds.fake_world)
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # count the local ops DTensor runs (this rank's shards), as the memory tracker does
        kwargs = kwargs or {}
        self.last_op = str(func.overloadpacket)
        try:
            out = func(*args, **kwargs)
        except Exception:
            self.failed_op = self.failed_op or self.last_op  # the innermost op raising (cleanup ops follow)
            raise
        self.counts.ops += 1
        self.sequence += 1
        self._count(func, args, kwargs, out, self._phase())
        return out

    def buffer_state(self) -> tuple[int, str]:
        """(live communication buffer bytes, the current phase): what the memory sampler records at a peak."""
        return self.live_buffer_bytes, self._phase()

    def _count(self, func: Any, args: Any, kwargs: dict, out: Any, phase: str) -> None:
        if func in _COLLECTIVES:
            if self.regions is not None:
                self.regions.account(None, extern=True, inputs=_tensors((args, kwargs)), outputs=[])
            self._count_collective(func, args, kwargs, out)
            return
        if func.namespace == "nemo_ac" and func.overloadpacket.__name__ in _DEEPEP_OPS:
            if self.regions is not None:
                self.regions.account(None, extern=True, inputs=_tensors((args, kwargs)), outputs=[])
            self._count_deepep(func.overloadpacket.__name__, args, out)
            return
        if func in _NO_TRAFFIC:
            return
        packet = func.overloadpacket
        flops = 0
        formula = flop_registry.get(packet)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            self.counts.flops[phase] += flops
        elif needs_formula(func):
            self.counts.without_formula[str(packet)] += 1
        outputs = _tensors(out)
        written = 0 if outputs else _written_bytes(func, args, kwargs)
        if (outputs or written) and packet.__name__ not in _FREE_PACKETS:  # no tensor out or written: metadata only
            inputs = _tensors((args, kwargs))
            if self._in_flight:  # views and metadata ops read nothing: they are not the first read
                self._mark_first_read(inputs)
            host_payload = _host_link_payload(packet.__name__, inputs, outputs)
            if host_payload:
                if self.regions is not None:
                    self.regions.account(None, extern=True, inputs=inputs, outputs=[])
                # An offloaded activation brought back when autograd asks for it is on the compute stream.
                link = "host_blocking" if copying_on_compute_stream() else "host"
                self.counts.costs.append(
                    OpCost(0, host_payload, 0, phase, name="host_copy", link=link, seq=self.sequence)
                )
                return
            moved = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs) + written
            # The lowest precision among the floating inputs: a kernel handed a bf16 operand multiplies on bf16
            # tensor cores (mamba_ssm's backward gets an fp32 gradient beside bf16 activations and casts it).
            bits = min((t.element_size() * 8 for t in inputs if t.is_floating_point()), default=32)
            if moved or flops:
                cost = OpCost(flops, moved, bits, phase, name=packet.__name__, seq=self.sequence)
                if self.regions is not None:
                    extern = is_extern(packet.__name__, func.namespace, flops)
                    self.regions.account(cost, extern=extern, inputs=inputs, outputs=outputs)
                self.counts.costs.append(cost)
