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

Upstream: none; this is how Dynamo is meant to be told. Delete when: never as such; a name listed here that the
model stops passing can go.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DynamicArg:
    """One per-micro-batch value compiled as a symbol from the first compile.

    name: field or argument name as it appears in a Dynamo source (``L['attn'].max_seqlen``,
        ``L['attn'].context_parallel.max_seqlen_q``, ``L['max_seqlen']``); matched wherever it occurs, so metadata
        that moves into another dataclass (ring CP's inputs in ``AttentionInputs.context_parallel``) stays covered.
    dim: None for a Python int; ``N`` for dim ``N`` of a tensor whose length changes per batch.
    """

    name: str
    dim: int | None
    owner: str


DYNAMIC_INT_ARGS: tuple[DynamicArg, ...] = (
    DynamicArg("max_seqlen", None, "AttentionInputs / UlyssesAttentionInputs: longest document of the micro batch"),
    DynamicArg("cu_seqlens", 0, "AttentionInputs / UlyssesAttentionInputs: one entry per document + 1"),
    DynamicArg("max_seqlen_q", None, "ring CP (AttentionInputs.context_parallel): longest local query document"),
    DynamicArg("max_seqlen_k", None, "ring CP (AttentionInputs.context_parallel): longest key document"),
    DynamicArg("local_k_slice", None, "ring CP (AttentionInputs.context_parallel): first attendable key position"),
)


def dynamic_source_patterns(args: Sequence[DynamicArg] = DYNAMIC_INT_ARGS) -> str:
    """``torch.compiler.config.dynamic_sources`` entries (comma separated regexes, ``:N`` = tensor dim N)."""
    entries = []
    for arg in args:
        name = re.escape(arg.name)
        pattern = rf".*(\.{name}|\['{name}'\])$"
        entries.append(pattern if arg.dim is None else f"{pattern}:{arg.dim}")
    return ",".join(entries)


def merge_dynamic_sources(current: str, extra: str) -> str:
    """``current`` plus the entries of ``extra`` it lacks (order kept; a user's own entries stay first)."""
    have = [s for s in current.split(",") if s]
    return ",".join(have + [s for s in extra.split(",") if s and s not in have])
