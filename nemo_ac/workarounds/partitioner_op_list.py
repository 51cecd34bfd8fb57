"""torch's list of compute-intensive ops (what AOTAutograd's min-cut partitioner prefers to save), read for nemo_ac's
selective AC policy.

Not a failure of its own: the selective policy (``distributed.activation_checkpointing.policy``) saves the ops torch
itself treats as expensive to recompute, so that its choice follows torch's as kernels are added, instead of a
copied list going stale. The list lives in ``torch._functorch.partitioners.get_default_op_list()`` (an ``OpTypes``
whose ``compute_intensive_ops`` is a set of OpOverloadPackets); there is no public equivalent.

Relies on: torch._functorch.partitioners.get_default_op_list().compute_intensive_ops.
Torch versions: checked on 2.13.0 (this tree's tests, ``nemo-ac doctor`` check ``partitioner_op_list``); nemo_ac
supports 2.12 - 2.15 (``workarounds.gates``). Where it is missing this returns an empty set and the policy falls back
to its own matmul and attention lists.
Upstream: none filed.
Delete when: the policy keeps its own complete list of compute-intensive ops, or torch makes the list public.
"""

from __future__ import annotations

from typing import Any


def compute_intensive_ops() -> frozenset[Any]:
    """The OpOverloadPackets torch's partitioner treats as compute intensive; empty where torch has no such list."""
    try:
        from torch._functorch.partitioners import get_default_op_list

        return frozenset(get_default_op_list().compute_intensive_ops)
    except (ImportError, AttributeError):
        return frozenset()
