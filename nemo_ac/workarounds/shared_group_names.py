"""Rank-independent names for the process groups that compiled graphs call collectives on, so the ranks of a node
compile a graph once (``compile.node_shared_cache``) even when they sit in different groups of one mesh dim.

Cost prevented (no error): a functional collective traced by Dynamo bakes its process group's *name* into the graph
as a constant (``torch.ops._c10d_functional.all_to_all_single.default(x, [1, 1], [1, 1], '7')``), and torch names a
group by a creation counter (``new_group`` without local synchronization: ``_world.group_count``) or a hash of its
ranks (``split_group``, ``use_local_synchronization=True``; ``distributed_c10d._process_group_name``). Under
``make run``'s EP2 x CP2 ranks 0, 1 run their CP all-to-alls on group ``'7'`` and ranks 2, 3 on ``'8'`` (EP: ``'13'``
/ ``'14'``), so every graph holding a collective has one FX graph cache key per group and the node lock
(``node_shared_compile``) shares it only inside a group: 32 compiles and 24 loads on the node where the graphs
themselves are equal up to the name.

Fix: register each such group a second time in this process's c10d group registry under a name that says only what
the group is for, ``nemo_ac:<role>`` (``cp``, ``ep``), and hand the functional collectives that name (a string is a
valid ``group`` for every ``torch.distributed._functional_collectives`` op) instead of the ``ProcessGroup``. A rank is
in one group of a mesh dim, so the name is unique in its process, every rank's graph now carries the same constant
and resolves it at run time to its own group (``c10d::resolve_process_group``: the per-process registry). The
group's own name, its store prefix, its backend and every other registry entry stay as they are: creating the groups
under a shared name instead cannot work, since the name is also the prefix of the rendezvous keys
(``PrefixStore(f"{group_name}/", store)`` in ``_new_process_group_helper``), and ``new_group`` / ``split_group`` /
``init_device_mesh`` take no name on torch 2.13 (``group_desc`` is a description, not a name).

Safe where: the name is taken by another group of this process (a second model over another mesh in one process)
-> the group's own name is returned (graphs per group again, never a collective on a wrong group).
``destroy_process_group()`` (the whole world) unregisters every name, these included.

Checked alternatives on 2.13: ``torch.distributed.config.compile_on_one_rank`` (the group as an opaque graph input)
fails with a ``ProcessGroup`` (``TypeError: cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object`` when
AOTAutograd deep-copies the lazily compiled backward) and with a ``DeviceMesh`` pickles the whole mesh, coordinates
included, into the cache key (more misses than before). ``ProcessGroup._set_group_name`` renames the group
everywhere (NCCL's pg uid and flight recorder, ``destroy_process_group``'s unregister) and is not used.

Relies on: torch._C._distributed_c10d._register_process_group / _unregister_process_group and
torch.distributed.distributed_c10d._resolve_process_group (a name -> group lookup that raises when the name is
unknown).
Torch versions: checked on 2.13.0 (``nemo-ac doctor`` check ``shared_group_names``); where a piece is missing the
group itself is returned (rank-specific graphs, as before).
Upstream: none filed (a rank-independent graph needs either a ``group_name`` argument to ``new_group`` /
``DeviceMesh`` dims that only has to be unique per process, or the FX graph cache keying a collective by its mesh dim
instead of the group's name).
Delete when: torch creates mesh groups with per-dim names that are equal across the groups of a dim, or compiles
collectives against an opaque group input that the FX graph cache keys by role.
"""

from __future__ import annotations

from typing import Any

PREFIX = "nemo_ac:"


def _registry() -> tuple[Any, Any, Any] | None:
    try:
        from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
        from torch.distributed.distributed_c10d import _resolve_process_group
    except ImportError:
        return None
    return _register_process_group, _resolve_process_group, _unregister_process_group


def _holder(resolve: Any, name: str) -> Any:
    try:
        return resolve(name)
    except (RuntimeError, ValueError):  # unknown name: c10d raises from its registry lookup
        return None


def available() -> bool:
    """Whether this torch lets a process group be registered (and resolved) under a second name."""
    return _registry() is not None


def shared_group_name(group: Any, *, role: str) -> Any:
    """``nemo_ac:<role>``, registered in this process for ``group``: a name that is the same on every rank for the
    groups of one mesh dim, for the functional collectives of compiled code to address ``group`` by.

    Idempotent for one group. Returns ``group`` itself when torch lacks the registry or the name already belongs to
    another group of this process (the caller passes the result wherever a functional collective takes a group)."""
    registry = _registry()
    if registry is None:
        return group
    register, resolve, _ = registry
    name = PREFIX + role
    holder = _holder(resolve, name)
    if holder is None:
        register(name, group)
        return name
    return name if holder == group else group


def release_shared_group_name(*, role: str) -> None:
    """Forget ``nemo_ac:<role>`` in this process (no-op when unknown); the group keeps its own name.
    ``destroy_process_group()`` of the whole world forgets every name already."""
    registry = _registry()
    if registry is not None and _holder(registry[1], PREFIX + role) is not None:
        registry[2](PREFIX + role)
