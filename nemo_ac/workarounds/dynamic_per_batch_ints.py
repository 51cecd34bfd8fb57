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

Upstream: none; this is how Dynamo is meant to be told. Delete when: never as such; a name listed here that the
model stops passing can go.
"""

from __future__ import annotations

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
    """Mark every dim but the last (the feature dim) of each tensor in ``tree`` (args, kwargs, outputs) dynamic for
    the next compiled frame that takes it; parameters and 1-d tensors (per-expert counts) are left alone."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, torch.nn.Parameter) and leaf.dim() >= 2:
            for dim in range(leaf.dim() - 1):
                torch._dynamo.maybe_mark_dynamic(leaf, dim)
