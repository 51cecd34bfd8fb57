"""Per-micro-batch Python ints (document lengths, ring CP offsets) compiled as symbols from the first compile.

Error prevented (any torch; packed variable-length rows, ring or ulysses CP, compiled blocks)::

    torch._dynamo hit config.recompile_limit (8)

after which Dynamo runs the block eagerly, silently; under AC(compile(block)) the recompute then fails as in
``forward_thread_compile_config``. Why: ``AttentionInputs.max_seqlen`` and ring CP's ``max_seqlen_q`` / ``max_seqlen_k``
/ ``local_k_slice`` are Python ints that change every micro batch; Dynamo specializes the first value, recompiles
on the second (automatic dynamic), and ``cu_seqlens`` changes length with the number of documents.

Fix: ``torch.compiler.config.dynamic_sources`` names them by regex (``dynamic_source_patterns``), so they are
backed-dynamic from the first compile, also in graph-break resume frames (same local names), and dominant over
``dynamic=False``. Why not ``mark_dynamic`` / ``mark_unbacked`` / ``shapes_spec``: ``mark_dynamic`` marks tensor
dims only (these are Python ints); ``mark_unbacked`` and torch 2.13's ``torch.compile(shapes_spec=)`` make
*unbacked* symbols, which fail on any Python branch or guard over the value (ring CP slices with them) and need
each compiled function's exact argument structure. Its one flaw, being per-thread config, is what
``forward_thread_compile_config`` repairs.

Tensors that cross an eager boundary inside a compiled block (the call of a nested FSDP unit -- the experts, the
fp32 router -- whose FSDP2 hooks graph-break) enter the next compiled frame with no dynamic dims: what Dynamo
learned in the graph before the break does not travel through eager code. With expert parallelism the rows an
expert-parallel rank receives change every step, and the frame after the experts call recompiled on it (tiny
Qwen3.6 MedPix recipe, 4 ranks, EP2 x CP2, once per rank)::

    tensor '___stack0' size mismatch at index 0. expected 166, actual 173

``mark_token_dims`` marks those tensors where they are eager (the nested unit's forward pre-hook and forward hook,
``nemo_ac.distributed.compile.boundaries``) with ``torch._dynamo.maybe_mark_dynamic``: a hint for the next frame
that takes the tensor as an input, which Dynamo may still specialize (a dim of 0 or 1, a size equal to a static
one) without an error. Why not ``mark_dynamic``: it raises when a dim specializes, which duck sizing does for a
row count that happens to equal a weight dim. Why not a source name: the frame after a graph-broken call holds
the call's result as ``___stack0``, a name every resume frame uses.

When rows vary in length per micro batch (synthetic ``data.fixed_length=false``), every token dim of a compiled
block's inputs changes between steps, and under automatic dynamic (``compile.dynamic: null``) each compiled block
was first compiled with the row length static and recompiled at the first other length (tiny Nemotron, rows of 64
then 40 tokens; with 80-token rows the guard had read ``shape[1] == 80`` in ``MoE.forward``)::

    tensor 'hidden' size mismatch at index 1. expected 64, actual 40

``mark_row_dims`` marks them where the block is entered eagerly (``distributed.compile.apply``): the hidden states'
and rope tables' dims but the feature dim, and every dim of the integer tensors beside them (document ids, positions,
the full rows' document ids of CP), inside the attention-metadata dataclasses too. Ints and 1-d tensors are left to
``DYNAMIC_INT_ARGS``. Also ``maybe_mark_dynamic``: a row length equal to a model dim is not an error (static dims
are no symbols, so duck sizing does not tie them; a tensor's other marked dim could be, which only ties two row
lengths), and a dim Dynamo must specialize shows up as a recompile in the compile summary instead.

Upstream: none; this is how Dynamo is meant to be told. Delete when: never as such; a name listed here that the
model stops passing can go.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
import torch.utils._pytree as pytree


@dataclass(frozen=True)
class DynamicArg:
    """One per-micro-batch value compiled as a symbol from the first compile.

    name: field or argument name as it appears in a Dynamo source (``L['attn'].max_seqlen``,
        ``L['attn'].context_parallel.max_seqlen_q``, ``L['max_seqlen']``); matched wherever it occurs, so metadata
        that moves into another dataclass (ring CP's inputs in ``AttentionInputs.context_parallel``) stays covered.
    dim: None for a Python int; ``N`` for dim ``N`` of a tensor whose length changes per batch.
    items: the value is a list of such ints (``L['ctx'].send_splits[0]``, ...): its items are declared.
    """

    name: str
    dim: int | None
    owner: str
    items: bool = False


DYNAMIC_INT_ARGS: tuple[DynamicArg, ...] = (
    DynamicArg("max_seqlen", None, "AttentionInputs / UlyssesAttentionInputs: longest document of the micro batch"),
    DynamicArg("cu_seqlens", 0, "AttentionInputs / UlyssesAttentionInputs: one entry per document + 1"),
    DynamicArg("max_seqlen_q", None, "ring CP (AttentionInputs.context_parallel): longest local query document"),
    DynamicArg("max_seqlen_k", None, "ring CP (AttentionInputs.context_parallel): longest key document"),
    DynamicArg("local_k_slice", None, "ring CP (AttentionInputs.context_parallel): first attendable key position"),
    # Expert parallelism's dispatch context lives across the graph break at the experts' FSDP unit: the frame after
    # the experts call takes it as a local (``L['ctx'].local_order``), with the rows this rank received that step.
    DynamicArg("local_order", 0, "EP (EPDispatchContext): received rows in local-expert order, one per row"),
    DynamicArg("send_splits", None, "EP (EPDispatchContext): rows sent to each EP rank", items=True),
    DynamicArg("recv_splits", None, "EP (EPDispatchContext): rows received from each EP rank", items=True),
    # The MoE's input shape, kept across the graph break at its nested FSDP units for the output's view: static ints
    # in the frame after the experts call would specialize the row length (``tensor 'flat' size mismatch at index
    # 0. expected 128, actual 80`` with rows of 64 then 40 tokens). ``view_as(x)`` instead trips torch 2.13's
    # ``AssertionError: sources must not be empty for symbol s27`` (x's sizes symbolic, x not in the graph).
    DynamicArg("token_shape", None, "MoE.forward (models.layers.moe): [B, S, H] of its input", items=True),
)


def dynamic_source_patterns(args: Sequence[DynamicArg] = DYNAMIC_INT_ARGS) -> str:
    """``torch.compiler.config.dynamic_sources`` entries (comma separated regexes, ``:N`` = tensor dim N)."""
    entries = []
    for arg in args:
        name = re.escape(arg.name)
        items = r"\[\d+\]" if arg.items else ""
        pattern = rf".*(\.{name}|\['{name}'\]){items}$"
        entries.append(pattern if arg.dim is None else f"{pattern}:{arg.dim}")
    return ",".join(entries)


def merge_dynamic_sources(current: str, extra: str) -> str:
    """``current`` plus the entries of ``extra`` it lacks (order kept; a user's own entries stay first)."""
    have = [s for s in current.split(",") if s]
    return ",".join(have + [s for s in extra.split(",") if s and s not in have])


def mark_token_dims(tree: Any) -> None:
    """Mark every dim but the last (the feature dim) of each tensor in ``tree`` (args, kwargs, outputs) and of a
    view's base dynamic for the next compiled frame that takes it; parameters and 1-d tensors (per-expert counts)
    are left alone."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, torch.nn.Parameter):
            for tensor in _with_base(leaf):
                for dim in range(tensor.dim() - 1 if tensor.dim() >= 2 else 0):
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def mark_row_dims(tree: Any) -> None:
    """Mark the token dims of every tensor in ``tree`` (a block's args and kwargs) dynamic for the compiled frame
    it enters: floating tensors of 2+ dims all dims but the last (features: hidden states, rope tables), integer
    tensors of 2+ dims every dim (document ids, positions). Descends into tuples, lists, dicts and dataclass
    instances (``AttentionInputs`` and CP's metadata are no pytrees); parameters and 1-d tensors are left alone."""
    for leaf in _tensors(tree, depth=0):
        if isinstance(leaf, torch.nn.Parameter):
            continue
        for tensor in _with_base(leaf):
            if tensor.dim() < 2:
                continue
            last = tensor.dim() if not (tensor.is_floating_point() or tensor.is_complex()) else tensor.dim() - 1
            for dim in range(last):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _with_base(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensor and, for a view, its base: a frame that takes a view (the block's ``hidden`` after a graph
    break) rebuilds it from ``L['hidden']._base``, whose dims compile static unless the base is marked too
    (``tensor 'hidden' size mismatch at index 1. expected 64, actual 40`` with only the view marked)."""
    base = tensor._base
    return (tensor,) if base is None else (tensor, base)


def _tensors(tree: Any, *, depth: int) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if depth > 4:  # block inputs nest two or three deep (kwargs -> AttentionInputs -> CP metadata)
        return []
    if isinstance(tree, (tuple, list)):
        children: Sequence[Any] = tree
    elif isinstance(tree, dict):
        children = list(tree.values())
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        children = [getattr(tree, f.name) for f in dataclasses.fields(tree)]
    else:
        return []
    return [leaf for child in children for leaf in _tensors(child, depth=depth + 1)]
