"""``apply_cp`` finds every sequence mixer of every family and swaps the right CP op in (gloo group of one)."""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from nemo_ac.config.schema import CompileConfig, ModelConfig, MoEConfig, ParallelConfig
from nemo_ac.distributed.blocks import decoder_layers
from nemo_ac.distributed.context_parallel import apply_cp
from nemo_ac.distributed.context_parallel.ring import ring_attention
from nemo_ac.distributed.context_parallel.state_passing import ring_ssm
from nemo_ac.distributed.context_parallel.ulysses import ulysses_attention, ulysses_linear_attention, ulysses_ssm
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.models import build_model
from nemo_ac.models.layers.attention import packed_causal_attention

MOE = MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def cp_mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    dist.destroy_process_group()


def _ops(model) -> list[tuple[str, object]]:
    found = []
    for block in decoder_layers(model):
        for module in block.modules():
            for attr in ("attn_op", "linear_attn_op", "ssm_op"):
                if hasattr(module, attr):
                    found.append((attr, getattr(module, attr)))
    return found


def _apply_cp(model, *, cp_mesh, cp_type: str) -> None:
    """The plan for cp_type at cp 2 (the plan checks the mixers), applied over the one-rank CP group."""
    plan = decide_plan(model, parallel=ParallelConfig(cp_type=cp_type), cp=2)
    apply_cp(model, plan=plan, cp_mesh=cp_mesh)


def _wrapped(op) -> object:
    return op.func if isinstance(op, functools.partial) else op


def test_ring_and_ulysses_replace_softmax_attention(cp_mesh) -> None:
    for cp_type, expected in (("ring", ring_attention), ("ulysses", ulysses_attention)):
        model = build_model(ModelConfig(num_layers=2, moe=MOE))
        _apply_cp(model, cp_mesh=cp_mesh, cp_type=cp_type)
        ops = _ops(model)
        assert len(ops) == 2 and all(_wrapped(op) is expected for _, op in ops)
        if cp_type == "ulysses":  # wraps, keeping the model's own op for the head shard
            assert all(op.keywords["inner"] is packed_causal_attention for _, op in ops)


def test_ulysses_wraps_every_mixer_of_a_hybrid_family_and_ring_replaces_each(cp_mesh) -> None:
    """Nemotron-H: a Mamba-2 layer, an attention layer and an MoE layer (which needs nothing). The Gated DeltaNet
    wrapper is checked against the unsharded mixer in tests/functional/test_ep_cp_ops.py."""
    moe = MoEConfig(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        score_func="sigmoid",
        score_correction_bias=True,
        activation="relu2",
        shared_expert_intermediate_size=16,
    )
    cfg = ModelConfig(family="nemotron_h", num_layers=3, layer_pattern="M*E", qk_norm=False, moe=moe)
    wrappers = {"attn_op": ulysses_attention, "linear_attn_op": ulysses_linear_attention, "ssm_op": ulysses_ssm}
    model = build_model(cfg)
    assert sorted(attr for attr, _ in _ops(model)) == ["attn_op", "ssm_op"]
    _apply_cp(model, cp_mesh=cp_mesh, cp_type="ulysses")
    assert sorted(attr for attr, op in _ops(model) if _wrapped(op) is wrappers[attr]) == ["attn_op", "ssm_op"]
    ring = build_model(cfg)
    _apply_cp(ring, cp_mesh=cp_mesh, cp_type="ring")  # attention: the K/V ring; Mamba-2: state passing
    assert {attr: _wrapped(op) for attr, op in _ops(ring)} == {"attn_op": ring_attention, "ssm_op": ring_ssm}


@pytest.mark.parametrize("cp_type", ["ulysses", "ring"])
def test_compiled_cp_ops_address_the_group_by_its_shared_name(cp_mesh, cp_type: str) -> None:
    """With compile.node_shared_cache (backend inductor) every CP op hands its collectives ``nemo_ac:cp``, the same
    name on every rank, so the graphs of ranks in different CP groups are equal and compile once per node
    (workarounds.shared_group_names); otherwise, and without compile, the group itself."""
    group = cp_mesh.get_group()
    cases = [(None, group), (CompileConfig(enabled=True, node_shared_cache=False), group)]
    for compile_config, expected in [*cases, (CompileConfig(enabled=True), "nemo_ac:cp")]:
        model = build_model(ModelConfig(num_layers=1, moe=MOE))
        plan = decide_plan(model, parallel=ParallelConfig(cp_type=cp_type), compile=compile_config, cp=2)
        apply_cp(model, plan=plan, cp_mesh=cp_mesh)
        assert [op.keywords["group"] for _, op in _ops(model)] == [expected], compile_config
