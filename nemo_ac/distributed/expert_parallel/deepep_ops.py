"""DeepEP's dispatch and combine as torch custom ops: selective AC saves their outputs, torch.compile sees one node.

Why custom ops. DeepEP's ``Buffer.dispatch`` / ``Buffer.combine`` are calls into a C++ extension, not torch ops: no
dispatch mode sees them. Called from an ``autograd.Function`` (what ``deepep_dispatcher`` did before), the
selective-AC policy never got to decide about them, so every recompute ran both all-to-alls again. As
``nemo_ac::deepep_dispatch`` and ``nemo_ac::deepep_combine`` they reach the SAC modes like any aten op; the policy
lists them with the collectives (``activation_checkpointing.policy``, MUST_SAVE), so the recompute replays their
saved outputs and communicates nothing. ``torch.compile`` traces each as one opaque node (fake impls below) instead
of tracing into DeepEP's Python.

The four ops, and DeepEP's own pairing of them (its README: "the backward process of MoE dispatch is actually a
combine", and the reverse):

- ``deepep_dispatch(x, topk_idx, topk_weights)`` -> ``(recv_x, recv_topk_idx, recv_topk_weights, handle)``:
  ``get_dispatch_layout`` then ``dispatch``. Backward: ``deepep_dispatch_backward``.
- ``deepep_dispatch_backward(grad_recv_x, grad_recv_weights, handle)`` -> ``(grad_x, grad_topk_weights)``:
  ``combine(grad_recv_x, handle, topk_weights=grad_recv_weights)``.
- ``deepep_combine(x, handle)`` -> ``combined``: ``combine(x, handle)``. Backward: ``deepep_combine_backward``.
- ``deepep_combine_backward(grad, handle)`` -> ``grad_x``: ``dispatch(grad, handle=handle)`` (the cached layout).
- ``deepep_dispatch_wait(handle)`` / ``deepep_combine_wait(handle)``: after ``deepep_dispatch`` or ``deepep_combine``
  with ``async_finish=True``, the compute stream waits for the transfer (DeepEP's ``EventOverlap.current_stream_wait``).
  Between the two, the compute stream runs what does not need the transfer's rows (the shared expert:
  ``MoE.forward``), as DeepEP's README overlaps communication.

Asynchronous backward. Where the forward's ops were asynchronous, so are their backwards, split in two ops:
``deepep_dispatch_backward_start`` / ``deepep_combine_backward_start`` issue the transfer (``async_finish``) and keep
its outputs in a registry under the handle; ``deepep_dispatch_backward_finish`` / ``deepep_combine_backward_finish``
wait for it and return them. The start runs in the backward of the forward's *wait*
(``deepep_dispatcher.DispatchArrived`` / ``CombineArrived``: identity functions on the transferred rows), the finish
in the op's own backward: autograd runs nodes newest first, so what the forward computed between the op and its wait
(the shared expert) has its backward run between start and finish, while the gradients travel. The finish does the
transfer itself when no start ran (an op called with ``async_finish`` outside the dispatcher).

The received token count is data-dependent: the fake impl of ``deepep_dispatch`` gives ``recv_x`` an unbacked size
(``torch.library.get_ctx().new_dynamic_size()``); every later op takes its sizes from tensors or int arguments. The
dry run (``nemo_ac.simulate``), whose fake tensors hold no router values, says the count instead
(``assume_received_rows``: its routing assumption).

The handle. DeepEP's ``handle`` is an opaque Python tuple (its layout: prefix matrices, source indices, ...), and a
custom op takes and returns tensors and scalars only. It travels as a *token*: a 0-dim CPU int64 tensor holding a
key into a per-process registry that holds the handle. The registry entry lives exactly as long as the token's
storage: a ``weakref.finalize`` on the storage drops the handle when the last tensor sharing it goes (the SAC cache,
autograd's saved tensors and compiled graphs' saved activations all keep the storage, whichever tensor object they
hold). So:

- selective AC that saves the ops: the recompute replays the forward's token and the backward finds its handle;
- full AC, or a policy that recomputes them: the forward's token dies with the forward, the recompute makes a new
  handle (communicating again, as full AC does) and the backward uses that one;
- no-grad forwards free their handles when their outputs go.

A CPU token costs no device sync to read. Passing DeepEP's handle tensors explicitly instead would need fake impls
that know DeepEP's internal handle layout (6 tensors intranode, 10 internode, V2 changed it to an object).

Buffers. The ops find their ``deep_ep.Buffer`` (or the test stand-in) through ``register_buffers``: an int key per
dispatcher (a compile-time constant), weakly held. Nothing here imports ``deep_ep``; registering the ops costs
nothing on machines without it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Protocol

import torch

from nemo_ac.models.kernels.op_flops import register_op_flops, zero_flops


class BufferSource(Protocol):
    """What the ops need from a dispatcher's buffer cache (``deepep_dispatcher.DeepEPBuffers``)."""

    topk_idx_dtype: torch.dtype
    group: Any  # the expert-parallel process group

    def get(self, hidden: torch.Tensor) -> Any:
        """The ``Buffer`` for tokens shaped like ``hidden`` (grown if it needs more bytes)."""
        ...


_SOURCES: weakref.WeakValueDictionary[int, BufferSource] = weakref.WeakValueDictionary()
_HANDLES: dict[int, Any] = {}
_PENDING: dict[int, Any] = {}  # handle key -> the DeepEP event of a dispatch still in flight (async_finish)
_PENDING_COMBINE: dict[int, Any] = {}  # handle key -> the event of the forward combine still in flight
# (direction, handle key) -> (outputs, event, inputs kept alive) of a backward transfer started and not yet finished
_EARLY_GRADS: dict[tuple[str, int], tuple[tuple[torch.Tensor, ...], Any, tuple[torch.Tensor, ...]]] = {}
_KEYS = itertools.count(1)
_ASSUMED_RECEIVED: dict[int, int] = {}  # buffers key -> tokens a dispatch receives, said by the dry run


def register_buffers(source: BufferSource) -> int:
    """The key the ops take as ``buffers_key`` to reach ``source`` (held weakly: it goes with its dispatcher)."""
    key = next(_KEYS)
    _SOURCES[key] = source
    return key


def assume_received_rows(buffers_key: int, rows: int) -> None:
    """The dry run's routing assumption: a dispatch through ``buffers_key`` receives ``rows`` tokens (its fake impl
    then gives ``recv_x`` that size, not an unbacked one)."""
    _ASSUMED_RECEIVED[buffers_key] = rows


def buffer_source(key: int) -> BufferSource:
    """The buffer cache registered under ``key`` (the ops get their Buffer there; the dry run's counter, the process
    group)."""
    source = _SOURCES.get(key)
    if source is None:
        raise RuntimeError(f"nemo_ac DeepEP ops: no buffer registered under key {key} (its dispatcher is gone)")
    return source


def _release(key: int) -> None:
    _HANDLES.pop(key, None)
    _PENDING.pop(key, None)
    _PENDING_COMBINE.pop(key, None)
    for direction in ("dispatch", "combine"):
        _EARLY_GRADS.pop((direction, key), None)


def _hold_handle(handle: Any, *, event: Any = None) -> torch.Tensor:
    """A token for ``handle`` (and the event of its dispatch, while in flight): the registry keeps them while the
    token's storage lives."""
    key = next(_KEYS)
    _HANDLES[key] = handle
    if event is not None:
        _PENDING[key] = event
    token = torch.tensor(key, dtype=torch.int64)
    weakref.finalize(token.untyped_storage(), _release, key)
    return token


def _handle(token: torch.Tensor) -> Any:
    key = int(token)
    try:
        return _HANDLES[key]
    except KeyError:
        raise RuntimeError(
            f"nemo_ac DeepEP ops: handle {key} was released while a tensor still named it (the token was copied "
            "into new storage); please report this with the AC and compile settings"
        ) from None


def live_handles() -> int:
    """Handles held right now (tests check that none leak)."""
    return len(_HANDLES)


def transfers_in_flight() -> int:
    """Asynchronous transfers issued and not yet waited for (tests check that none is left after a step)."""
    return len(_PENDING) + len(_PENDING_COMBINE) + len(_EARLY_GRADS)


# --- dispatch -------------------------------------------------------------------------------------------------


@torch.library.custom_op("nemo_ac::deepep_dispatch", mutates_args=())
def deepep_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    buffers_key: int,
    num_experts: int,
    async_finish: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H]; topk_idx [T, k] global expert ids; topk_weights [T, k] fp32. Returns the rows this rank receives
    (each token once per destination rank, source-rank major): recv_x [R, H], recv_topk_idx [R, k] (local expert ids,
    -1: the slot's expert lives elsewhere), recv_topk_weights [R, k] fp32 (0 where -1), and the handle token.

    ``async_finish``: DeepEP's own flag. The transfer runs on DeepEP's communication stream and the compute stream
    does not wait for it here: ``deepep_dispatch_wait(handle)`` makes it wait, and nothing may read the received rows
    before that call (``DeepEPDispatcher.dispatch_finish`` makes it first)."""
    source = buffer_source(buffers_key)
    buffer = source.get(x)
    idx = topk_idx.to(source.topk_idx_dtype)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    recv_x, recv_idx, recv_weights, _, handle, event = buffer.dispatch(
        x,
        topk_idx=idx,
        topk_weights=topk_weights,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        async_finish=async_finish,
    )
    token = _hold_handle(handle, event=event if async_finish else None)
    return recv_x, recv_idx.to(topk_idx.dtype), recv_weights, token


@deepep_dispatch.register_fake
def _(x, topk_idx, topk_weights, buffers_key, num_experts, async_finish=False):
    # Traced by dynamo the key may be symbolic: only the dry run (eager, concrete keys) says the count.
    received = _ASSUMED_RECEIVED.get(buffers_key) if isinstance(buffers_key, int) else None
    if received is None:
        received = torch.library.get_ctx().new_dynamic_size()
    return (
        x.new_empty(received, x.shape[1]),
        topk_idx.new_empty(received, topk_idx.shape[1]),
        topk_weights.new_empty(received, topk_weights.shape[1]),
        torch.empty((), dtype=torch.int64),
    )


@torch.library.custom_op("nemo_ac::deepep_dispatch_backward", mutates_args=())
def deepep_dispatch_backward(
    grad_recv_x: torch.Tensor, grad_recv_weights: torch.Tensor, handle: torch.Tensor, buffers_key: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of dispatch: the received rows' gradients summed back onto their source tokens ([T, H], and the
    weights' gradients [T, k] fp32)."""
    grad_x, grad_weights, _ = _combine_gradients(
        grad_recv_x, grad_recv_weights, handle, buffers_key, async_finish=False
    )
    return grad_x, grad_weights


def _combine_gradients(grad_recv_x, grad_recv_weights, handle, buffers_key: int, *, async_finish: bool) -> tuple:
    buffer = buffer_source(buffers_key).get(grad_recv_x)
    return buffer.combine(
        grad_recv_x.contiguous(),
        _handle(handle),
        topk_weights=grad_recv_weights.float().contiguous(),
        async_finish=async_finish,
    )


def _dispatch_backward_fake(grad_recv_x, grad_recv_weights, handle, buffers_key, num_tokens):
    return (
        grad_recv_x.new_empty(num_tokens, grad_recv_x.shape[1]),
        grad_recv_weights.new_empty(num_tokens, grad_recv_weights.shape[1], dtype=torch.float32),
    )


deepep_dispatch_backward.register_fake(_dispatch_backward_fake)


@torch.library.custom_op("nemo_ac::deepep_dispatch_backward_start", mutates_args=())
def deepep_dispatch_backward_start(
    grad_recv_x: torch.Tensor, grad_recv_weights: torch.Tensor, handle: torch.Tensor, buffers_key: int, num_tokens: int
) -> None:
    """``deepep_dispatch_backward``'s transfer issued with ``async_finish``: its outputs wait in the registry for
    ``deepep_dispatch_backward_finish`` (module docstring, "Asynchronous backward")."""
    grad_x, grad_weights, event = _combine_gradients(
        grad_recv_x, grad_recv_weights, handle, buffers_key, async_finish=True
    )
    _EARLY_GRADS[("dispatch", int(handle))] = ((grad_x, grad_weights), event, (grad_recv_x, grad_recv_weights))


@deepep_dispatch_backward_start.register_fake
def _(grad_recv_x, grad_recv_weights, handle, buffers_key, num_tokens):
    return None


def _take_early(direction: str, handle: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    early = _EARLY_GRADS.pop((direction, int(handle)), None)
    if early is None:
        return None
    outputs, event, _inputs = early
    event.current_stream_wait()
    return outputs


@torch.library.custom_op("nemo_ac::deepep_dispatch_backward_finish", mutates_args=())
def deepep_dispatch_backward_finish(
    grad_recv_x: torch.Tensor, grad_recv_weights: torch.Tensor, handle: torch.Tensor, buffers_key: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of the started ``deepep_dispatch_backward_start`` once they have arrived (the compute stream
    waits for them here); without a start, ``deepep_dispatch_backward`` itself."""
    early = _take_early("dispatch", handle)
    if early is None:
        grad_x, grad_weights, _ = _combine_gradients(
            grad_recv_x, grad_recv_weights, handle, buffers_key, async_finish=False
        )
        return grad_x, grad_weights
    return early[0], early[1]


deepep_dispatch_backward_finish.register_fake(_dispatch_backward_fake)  # the same outputs, started or not


def _dispatch_setup_context(ctx, inputs, output) -> None:
    x, _topk_idx, _topk_weights, buffers_key, _num_experts, *rest = inputs
    ctx.save_for_backward(output[3])
    ctx.buffers_key = buffers_key
    ctx.num_tokens = x.shape[0]
    ctx.async_finish = bool(rest[0]) if rest else False


def _dispatch_backward(ctx, grad_recv_x, _grad_idx, grad_recv_weights, _grad_handle):
    (handle,) = ctx.saved_tensors
    backward = (
        torch.ops.nemo_ac.deepep_dispatch_backward_finish
        if ctx.async_finish
        else torch.ops.nemo_ac.deepep_dispatch_backward
    )
    grad_x, grad_weights = backward(grad_recv_x, grad_recv_weights, handle, ctx.buffers_key, ctx.num_tokens)
    return grad_x, None, grad_weights, None, None, None


deepep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup_context)


@torch.library.custom_op("nemo_ac::deepep_dispatch_wait", mutates_args=())
def deepep_dispatch_wait(handle: torch.Tensor) -> None:
    """The compute stream waits for the dispatch of ``handle`` (``async_finish``); nothing when it was synchronous
    or has been waited for (a selective-AC recompute that replays the dispatch's saved outputs waits for nothing)."""
    event = _PENDING.pop(int(handle), None)
    if event is not None:
        event.current_stream_wait()


@deepep_dispatch_wait.register_fake
def _(handle):
    return None


# --- combine --------------------------------------------------------------------------------------------------


@torch.library.custom_op("nemo_ac::deepep_combine", mutates_args=())
def deepep_combine(
    x: torch.Tensor, handle: torch.Tensor, buffers_key: int, num_tokens: int, async_finish: bool = False
) -> torch.Tensor:
    """x [R, H] (one row per received token, already weighted) -> [T, H]: each token's rows from every rank it went
    to, summed (DeepEP's combine adds without weights). ``async_finish``: nothing may read the output before
    ``deepep_combine_wait(handle)``."""
    buffer = buffer_source(buffers_key).get(x)
    combined, _, event = buffer.combine(x.contiguous(), _handle(handle), async_finish=async_finish)
    if async_finish:
        _PENDING_COMBINE[int(handle)] = event
    return combined


@deepep_combine.register_fake
def _(x, handle, buffers_key, num_tokens, async_finish=False):
    return x.new_empty(num_tokens, x.shape[1])


@torch.library.custom_op("nemo_ac::deepep_combine_wait", mutates_args=())
def deepep_combine_wait(handle: torch.Tensor) -> None:
    """The compute stream waits for the forward combine of ``handle`` (``async_finish``); as
    ``deepep_dispatch_wait``."""
    event = _PENDING_COMBINE.pop(int(handle), None)
    if event is not None:
        event.current_stream_wait()


@deepep_combine_wait.register_fake
def _(handle):
    return None


@torch.library.custom_op("nemo_ac::deepep_combine_backward", mutates_args=())
def deepep_combine_backward(
    grad: torch.Tensor, handle: torch.Tensor, buffers_key: int, num_received: int
) -> torch.Tensor:
    """The backward of combine: each token's gradient sent again to every rank it went to ([R, H])."""
    return _dispatch_gradient(grad, handle, buffers_key, async_finish=False)[0]


def _dispatch_gradient(grad, handle, buffers_key: int, *, async_finish: bool) -> tuple:
    buffer = buffer_source(buffers_key).get(grad)
    recv_grad, *_, event = buffer.dispatch(grad.contiguous(), handle=_handle(handle), async_finish=async_finish)
    return recv_grad, event


def _combine_backward_fake(grad, handle, buffers_key, num_received):
    return grad.new_empty(num_received, grad.shape[1])


deepep_combine_backward.register_fake(_combine_backward_fake)


@torch.library.custom_op("nemo_ac::deepep_combine_backward_start", mutates_args=())
def deepep_combine_backward_start(
    grad: torch.Tensor, handle: torch.Tensor, buffers_key: int, num_received: int
) -> None:
    """``deepep_combine_backward``'s transfer issued with ``async_finish``; ``deepep_combine_backward_finish`` takes
    its output."""
    recv_grad, event = _dispatch_gradient(grad, handle, buffers_key, async_finish=True)
    _EARLY_GRADS[("combine", int(handle))] = ((recv_grad,), event, (grad,))


@deepep_combine_backward_start.register_fake
def _(grad, handle, buffers_key, num_received):
    return None


@torch.library.custom_op("nemo_ac::deepep_combine_backward_finish", mutates_args=())
def deepep_combine_backward_finish(
    grad: torch.Tensor, handle: torch.Tensor, buffers_key: int, num_received: int
) -> torch.Tensor:
    """The output of the started ``deepep_combine_backward_start`` once it has arrived; without a start,
    ``deepep_combine_backward`` itself."""
    early = _take_early("combine", handle)
    if early is None:
        return _dispatch_gradient(grad, handle, buffers_key, async_finish=False)[0]
    return early[0]


deepep_combine_backward_finish.register_fake(_combine_backward_fake)  # the same output, started or not


def _combine_setup_context(ctx, inputs, output) -> None:
    x, handle, buffers_key, _num_tokens, *rest = inputs
    ctx.save_for_backward(handle)
    ctx.buffers_key = buffers_key
    ctx.num_received = x.shape[0]
    ctx.async_finish = bool(rest[0]) if rest else False


def _combine_backward(ctx, grad):
    (handle,) = ctx.saved_tensors
    backward = (
        torch.ops.nemo_ac.deepep_combine_backward_finish
        if ctx.async_finish
        else torch.ops.nemo_ac.deepep_combine_backward
    )
    return backward(grad, handle, ctx.buffers_key, ctx.num_received), None, None, None, None


deepep_combine.register_autograd(_combine_backward, setup_context=_combine_setup_context)


# Data movement only: FlopCounterMode and nemo-ac plan count DeepEP's dispatch / combine as 0 FLOPs, by formula.
for _op in (
    deepep_dispatch,
    deepep_dispatch_backward,
    deepep_dispatch_backward_start,
    deepep_dispatch_backward_finish,
    deepep_dispatch_wait,
    deepep_combine,
    deepep_combine_backward,
    deepep_combine_backward_start,
    deepep_combine_backward_finish,
    deepep_combine_wait,
):
    register_op_flops(getattr(torch.ops.nemo_ac, _op._name.split("::")[-1]), zero_flops)
