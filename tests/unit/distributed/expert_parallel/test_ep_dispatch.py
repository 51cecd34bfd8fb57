"""Expert-parallel dispatch in one process: the permutations with uneven counts (a zero-token expert included),
the all-to-all dispatcher on a real gloo group of one, and the deepep dispatcher's errors without deep_ep.

Multi-rank dispatch (real uneven all-to-alls) is checked against the local dispatcher in
tests/functional/test_ep_cp_ops.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from nemo_ac.config import ConfigError
from nemo_ac.config.schema import BackendConfig, ModelConfig, MoEConfig
from nemo_ac.distributed.expert_parallel import apply_ep, build_dispatcher, source_major_to_expert_major
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.models import build_model
from nemo_ac.models.kernels.dispatch import LocalDispatcher
from nemo_ac.models.layers.experts import GroupedExperts

H, INTER = 12, 6


def test_source_major_to_expert_major_with_uneven_and_zero_counts() -> None:
    # 3 source ranks x 3 local experts; expert 1 receives nothing at all, source 2 sends nothing to expert 0.
    recv_counts = torch.tensor([[2, 0, 1], [1, 0, 3], [0, 0, 2]])
    labels = [(src, e, i) for src in range(3) for e in range(3) for i in range(int(recv_counts[src, e]))]
    order, per_expert = source_major_to_expert_major(recv_counts)
    assert per_expert.tolist() == [3, 0, 6]
    reordered = [labels[j] for j in order.tolist()]
    # Expert-major, and within an expert by source rank then arrival order (stable).
    assert reordered == sorted(labels, key=lambda t: (t[1], t[0], t[2]))


def test_source_major_to_expert_major_all_empty() -> None:
    order, per_expert = source_major_to_expert_major(torch.zeros(2, 4, dtype=torch.int64))
    assert order.numel() == 0 and per_expert.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("shared_name", [False, True], ids=["group", "shared_name"])
def test_all_to_all_dispatcher_on_one_rank_equals_local_dispatcher(world, shared_name: bool) -> None:
    """Same rows, counts and combine (values and gradients), expert 3 routed no token; also with the collectives
    addressing the group by its shared name (``build_dispatcher(shared_group_names=True)``, compiled runs)."""
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    dispatcher_ep = build_dispatcher("torch", ep_mesh=mesh, num_experts=5, shared_group_names=shared_name)
    assert dispatcher_ep.group is mesh.get_group()
    assert dispatcher_ep.collective_group == ("nemo_ac:ep" if shared_name else mesh.get_group())
    num_experts = 5
    top_idx = torch.tensor([[0, 1], [0, 2], [4, 0], [1, 0], [0, 4], [2, 1], [0, 1]])
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(num_experts, H, INTER)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hidden = torch.randn(top_idx.shape[0], H, generator=gen)
    scores = torch.rand(top_idx.shape, generator=gen)
    results = []
    for dispatcher in (LocalDispatcher(), dispatcher_ep):
        x, s = hidden.clone().requires_grad_(), scores.clone().requires_grad_()
        experts.zero_grad()
        rows, counts, ctx = dispatcher.dispatch(x, top_idx, num_experts, top_scores=s)
        out = dispatcher.combine(experts(rows, counts), s, ctx)
        out.pow(2).sum().backward()
        results.append((rows.detach(), counts, out.detach(), x.grad, s.grad, experts.down_proj.grad.clone()))
    (rows_l, counts_l, *rest_l), (rows_e, counts_e, *rest_e) = results
    assert counts_l.tolist() == counts_e.tolist() == [6, 4, 2, 0, 2]
    torch.testing.assert_close(rows_e, rows_l, rtol=0, atol=0)
    for got, want in zip(rest_e, rest_l):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.all(results[1][-1][3] == 0)  # the zero-token expert gets a zero gradient


def test_the_plan_refuses_deepep_without_ep_and_apply_ep_trusts_it() -> None:
    model = build_model(ModelConfig(num_layers=1, moe=MoEConfig(num_experts=4)))
    with pytest.raises(ConfigError, match=r"backend.dispatcher: deepep moves tokens .* parallel.ep is 1"):
        decide_plan(model, backend=BackendConfig(dispatcher="deepep"))
    apply_ep(model, plan=decide_plan(model), ep_mesh=None)  # ep 1: the local dispatcher stays
    moes = [module for module in model.modules() if hasattr(module, "set_dispatcher")]
    assert moes and all(type(moe.dispatcher) is LocalDispatcher for moe in moes)


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="deep_ep is installed here")
def test_deepep_dispatcher_without_deep_ep_names_key_and_install(world) -> None:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    with pytest.raises(ConfigError) as info:
        build_dispatcher("deepep", ep_mesh=mesh, num_experts=4)
    message = str(info.value)
    assert "backend.dispatcher: 'deepep' needs DeepEP" in message
    assert "git clone https://github.com/deepseek-ai/DeepEP" in message and "python setup.py install" in message
