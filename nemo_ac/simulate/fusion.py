"""What torch.compile leaves of a compiled block's memory traffic: the estimate's fusion model, one stated method.

The dry run executes the eager op stream (``torch.compile`` cannot run on fake tensors across a fake process group),
and the plan says which blocks the run compiles (``BlockPlan.compile_layout``). Inside such a block inductor turns
the graph into kernels: ops with FLOPs (matmuls, grouped GEMMs, attention), custom ops and a few ops it falls back on
(``EXTERN_PACKETS``: sorts, top-k, nonzero) stay their own kernels, and every other op (pointwise, reductions,
casts, copies, indexing) is fused with its neighbours. So a fused op costs the bytes its kernel must move:

- it reads a tensor from memory (HBM) only when the tensor is materialized: made outside this block instance, by an
  extern kernel, or written by another fused op because something needed it materialized; read once per block
  instance (a fused kernel loads each input once);
- its output is written only when something needs it in memory: an extern kernel or code outside the block consumes
  it, or it is still alive when the block ends (a block output, or a tensor saved for backward);
- an in-place op or one with ``out=`` writes into existing memory: always written.

The forward of a compiled block (and its recompute, under activation checkpointing) is found through forward hooks on
the block; its backward through the autograd nodes its forward created (``workarounds.fake_world``: the node the
engine runs and its creation number), since AOTAutograd compiles and fuses the backward graph alike. Ops outside
compiled blocks (the optimizer step, FSDP's copies, the loss, eager blocks) keep their eager traffic. FLOPs never
change: only bytes do, and a fused op's time is its bytes on the HBM roofline. This is the model torch.compile
approaches; it does not know of fusion across a graph break or inductor's recomputation of cheap ops in backward.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from nemo_ac.distributed.blocks import unwrap_block
from nemo_ac.simulate.op_cost import OpCost
from nemo_ac.workarounds.fake_world import autograd_sequence_nr, in_backward, running_autograd_sequence_nr

# aten ops inductor does not fuse (a fallback kernel of their own) although they do no FLOPs.
EXTERN_PACKETS = frozenset(
    {"sort", "topk", "argsort", "nonzero", "unique", "_unique2", "unique_consecutive", "bincount", "histc",
     "searchsorted", "multinomial", "randperm", "masked_select", "repeat_interleave", "_local_scalar_dense"}
)  # fmt: skip


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(eq=False)
class _Instance:
    """One execution of a compiled block: its forward, its recompute, or its backward."""

    path: str
    read: dict[int, weakref.ref] = field(default_factory=dict)  # storages already read by a fused op
    entry: int = -1  # a forward: the newest autograd node number at its entry
    recompute: bool = False  # entered in backward: an activation checkpoint's recompute


@dataclass(eq=False)
class _Pending:
    """A fused op's output nothing has needed in memory yet: its write is charged to ``cost`` once it is."""

    storage: weakref.ref
    nbytes: int
    cost: OpCost
    instance: _Instance


class CompiledRegions:
    """The fusion model of the module docstring, consulted by ``StepCounter`` for every compute op."""

    def __init__(self) -> None:
        self._stack: list[_Instance] = []  # forward / recompute instances entered through module hooks
        self._ranges: list[tuple[int, int, str]] = []  # (first, last) node numbers a block's forward created
        self._backward: _Instance | None = None
        self._pending: dict[int, _Pending] = {}
        self._handles: list[Any] = []
        self.blocks = 0

    def attach(self, model: nn.Module, paths: Iterable[str]) -> None:
        """Hooks on each compiled block (under its activation-checkpoint wrapper, so its recompute is seen too)."""
        for path in paths:
            block = unwrap_block(model.get_submodule(path))
            self._handles.append(block.register_forward_pre_hook(self._enter_hook(path), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._exit_hook(path), with_kwargs=True))
            self.blocks += 1

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter_hook(self, path: str) -> Any:
        def enter(module: nn.Module, args: Any, kwargs: Any) -> None:
            entry = max(_node_numbers((args, kwargs)), default=self._last_recorded())
            self._stack.append(_Instance(path, entry=entry, recompute=in_backward()))

        return enter

    def _exit_hook(self, path: str) -> Any:
        def exit_(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not self._stack or self._stack[-1].path != path:
                return
            instance = self._stack.pop()
            self._flush(instance)
            if not instance.recompute:  # a first forward: its nodes are the ones backward runs
                last = max(_node_numbers(output), default=instance.entry)
                if last > instance.entry:
                    self._ranges.append((instance.entry + 1, last, instance.path))

        return exit_

    def _end_stopped_recomputes(self) -> None:
        """torch's checkpoint stops a recompute early once every saved tensor is back (its forward never returns,
        so no exit hook runs): a backward op (grad mode off) after a recompute instance ends it."""
        while self._stack and self._stack[-1].recompute and not torch.is_grad_enabled():
            self._flush(self._stack.pop())

    def _last_recorded(self) -> int:
        return self._ranges[-1][1] if self._ranges else -1

    def _backward_instance(self) -> _Instance | None:
        number = running_autograd_sequence_nr()
        path = None
        if number is not None:
            index = bisect.bisect_right(self._ranges, (number, float("inf"), "")) - 1
            if index >= 0 and self._ranges[index][0] <= number <= self._ranges[index][1]:
                path = self._ranges[index][2]
        current = self._backward
        if current is not None and current.path == path:
            return current
        if current is not None:
            self._flush(current)
        self._backward = _Instance(path) if path is not None else None
        return self._backward

    def current(self) -> _Instance | None:
        if self._stack and in_backward():
            self._end_stopped_recomputes()
        if self._stack:
            return self._stack[-1]
        if in_backward():
            return self._backward_instance()
        if self._backward is not None:
            self._flush(self._backward)
            self._backward = None
        return None

    def _pending_of(self, tensor: torch.Tensor) -> _Pending | None:
        storage = tensor.untyped_storage()
        pending = self._pending.get(id(storage))
        return pending if pending is not None and pending.storage() is storage else None

    def _materialize(self, pending: _Pending) -> None:
        pending.cost.compiled_bytes = (pending.cost.compiled_bytes or 0) + pending.nbytes
        del self._pending[id(pending.storage())]

    def _flush(self, instance: _Instance) -> None:
        """A block instance ends: what it made and is still alive was written; the rest was fused away."""
        for key, pending in list(self._pending.items()):
            if pending.instance is not instance:
                continue
            if pending.storage() is not None:
                pending.cost.compiled_bytes = (pending.cost.compiled_bytes or 0) + pending.nbytes
            del self._pending[key]

    def finish(self) -> None:
        """The end of a counted segment (a micro batch, the update): every open backward instance ends."""
        if self._backward is not None:
            self._flush(self._backward)
            self._backward = None
        if not self._stack:
            self._ranges.clear()

    def account(
        self, cost: OpCost | None, *, extern: bool, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
    ) -> None:
        """Set ``cost.compiled_bytes`` for an op of a compiled block, and charge the pending writes it consumes
        (``cost`` None: a collective or a host copy, which only consumes)."""
        instance = self.current()
        for tensor in inputs:
            pending = self._pending_of(tensor)
            if pending is not None and (extern or pending.instance is not instance):
                self._materialize(pending)
        if instance is None or extern or cost is None:
            return
        read = 0
        input_storages: set[int] = set()
        for tensor in inputs:
            storage = tensor.untyped_storage()
            input_storages.add(id(storage))
            if self._pending_of(tensor) is not None:
                continue  # made by a fused op of this instance: in registers, not memory
            seen = instance.read.get(id(storage))
            if seen is not None and seen() is storage:
                continue
            instance.read[id(storage)] = weakref.ref(storage)
            read += _nbytes(tensor)
        written = 0
        for tensor in outputs:
            storage = tensor.untyped_storage()
            if self._pending_of(tensor) is not None:
                continue  # in place on a fused op's output: still in registers
            if id(storage) in input_storages:
                written += _nbytes(tensor)  # in place / out=: into memory that exists
                continue
            self._pending[id(storage)] = _Pending(weakref.ref(storage), _nbytes(tensor), cost, instance)
        cost.compiled_bytes = (cost.compiled_bytes or 0) + read + written


def is_extern(packet_name: str, namespace: str, flops: int) -> bool:
    """An op inductor leaves as its own kernel: FLOPs (matmuls, attention), a custom op, or a fallback."""
    return flops > 0 or namespace != "aten" or packet_name in EXTERN_PACKETS


def _node_numbers(value: Any) -> list[int]:
    numbers = []
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            number = autograd_sequence_nr(leaf.grad_fn)
            if number is not None:
                numbers.append(number)
    return numbers
