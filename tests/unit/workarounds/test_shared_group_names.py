"""Rank-independent group names (``workarounds.shared_group_names``): two different groups of one process stand in
for the groups of one mesh dim on two ranks. Traced with their own names their graphs differ (what made ``make
run``'s ranks compile per EP / CP group); addressed by the role's name, the graph of either is the same text."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from nemo_ac.workarounds.shared_group_names import PREFIX, release_shared_group_name, shared_group_name

pytestmark = pytest.mark.workaround


def _graph(group: dist.ProcessGroup | str) -> str:
    def exchange(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_to_all_single(x * 2, None, None, group) + 1

    return make_fx(exchange)(torch.ones(4)).code


def test_groups_of_one_role_trace_to_one_graph_under_the_shared_name(world) -> None:
    first, second = dist.new_group([0]), dist.new_group([0])
    assert _graph(first) != _graph(second)  # each group's own name is baked into its graph
    graphs = []
    for group in (first, second):  # as the two ranks would, each with its own group of the dim
        name = shared_group_name(group, role="test")
        assert name == PREFIX + "test" and shared_group_name(group, role="test") == name  # idempotent
        graphs.append(_graph(name))
        assert funcol.all_to_all_single(torch.arange(3.0), None, None, name).tolist() == [0.0, 1.0, 2.0]
        release_shared_group_name(role="test")
    assert graphs[0] == graphs[1] and repr(PREFIX + "test") in graphs[0]


def test_a_name_held_by_another_group_is_never_taken_over(world) -> None:
    """Two groups of one role in one process (a second model over another mesh): the second keeps its own name, so
    no compiled collective ever resolves to the wrong group."""
    first, second = dist.new_group([0]), dist.new_group([0])
    try:
        assert shared_group_name(first, role="taken") == PREFIX + "taken"
        assert shared_group_name(second, role="taken") is second
    finally:
        release_shared_group_name(role="taken")
    release_shared_group_name(role="taken")  # unknown: nothing to do
    assert shared_group_name(second, role="taken") == PREFIX + "taken"
    release_shared_group_name(role="taken")
