"""Modules inside a block that Dynamo will not trace, found when the plan is made.

Why the planner needs them: Transformer Engine decorates its modules' ``forward`` with ``no_torch_dynamo`` (that is
``torch._dynamo.disable``), and so may a user's own module. Inside a compiled block each such call is a graph
break. Under compile(AC(block)) that is fatal to the whole block, silently: Dynamo traces the checkpoint as one
higher-order op, cannot split it at a graph break, and runs the entire checkpointed block eagerly. The symptom is
the compiled entry frame capturing no graph (``CompileAccounting``'s "compile(AC(block)) captured no graph"
warning) and a block that is exactly as slow as eager. Under AC(compile(block)) the same break only splits the
compiled block into graphs around the disabled call; the rest still compiles. So the plan puts every block that
holds one into ``ac_outer`` (``compile.layout: auto``), rejects ``compile_outer`` / ``fullgraph`` for it, and prints
what breaks where; the run's compile report counts the graph breaks that result.

Two sources, both read without running anything:
- the TE modules ``apply_te_backends`` will swap in (``te_swap_counts``: the plan is made before the swap);
- modules already in the block whose ``forward`` is Dynamo-disabled (``torch.compiler.disable``; torch has no public
  query for it, ``workarounds.dynamo_disable_marker`` reads the private marker).
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from nemo_ac.distributed.blocks import unwrap_block
from nemo_ac.models.te_backend import te_swap_counts
from nemo_ac.workarounds.dynamo_disable_marker import is_dynamo_disabled


def dynamo_disabled_modules(block: nn.Module) -> Counter[str]:
    """Class name -> count of the block's modules whose forward Dynamo skips (outermost ones only: a disabled
    module's children never run under Dynamo, so they add no break of their own)."""
    counts: Counter[str] = Counter()
    skipped: list[str] = []
    for name, module in unwrap_block(block).named_modules():
        if any(name.startswith(prefix + ".") for prefix in skipped):
            continue
        forward = module.__dict__.get("forward", type(module).forward)
        if is_dynamo_disabled(forward):
            counts[type(module).__name__] += 1
            skipped.append(name)
    return counts


def untraceable_modules(block: nn.Module, *, linear: str, rms_norm: str, attention: str) -> tuple[tuple[str, int], ...]:
    """(class name, count) of what will graph-break inside ``block`` once the plan is applied, sorted by name:
    the TE modules the ``backend.*: te`` keys swap in, and modules already Dynamo-disabled."""
    counts = dynamo_disabled_modules(block)
    counts.update(te_swap_counts(unwrap_block(block), linear=linear, rms_norm=rms_norm, attention=attention))
    return tuple(sorted(counts.items()))


def describe_untraceable(untraceable: tuple[tuple[str, int], ...]) -> str:
    """``te.Linear x7, te.RMSNorm x2`` for the printed plan."""
    return ", ".join(f"{name} x{count}" for name, count in untraceable)
