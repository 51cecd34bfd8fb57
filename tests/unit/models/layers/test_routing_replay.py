"""The recompute of a checkpointed MoE block reuses the forward's routing (``models.layers.routing_replay``).

A test-only perturbation makes the router choose other experts whenever it runs inside backward (that is, in a
checkpoint's recompute), as a non-deterministic router GEMM, router noise or a changed expert bias would. Without
the replay the gradients come out silently wrong (no EP here: the shapes still match); with it they equal the
gradients of the same model without activation checkpointing, bit for bit, in every AC mode and compile layout.
The EP case, where the old behaviour dies with a CheckpointError, is ``tests/functional/test_routing_replay.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from nemo_ac.config.schema import ActivationCheckpointingConfig, CompileConfig
from nemo_ac.distributed.activation_checkpointing import apply_ac
from nemo_ac.distributed.compile import apply_compile
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers import routing_replay
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.models.layers.routing_replay import RoutingRecord, choose_experts, routing_replay_context, select_experts
from tests.factories import glm_config


@pytest.fixture
def reroute_in_backward(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Inside backward the router picks each token's experts shifted by one (a different, valid choice); returns
    a list counting the choices made inside backward."""
    in_backward: list[int] = []
    real = routing_replay.choose_experts

    def perturbed(scores, bias, **kwargs):
        ids = real(scores, bias, **kwargs)
        if torch._C._current_graph_task_id() != -1:
            in_backward.append(1)
            return (ids + 1) % scores.shape[-1]
        return ids

    monkeypatch.setattr(routing_replay, "choose_experts", perturbed)
    return in_backward


def tiny(ac_mode: str, *, replay: bool = True, compile_config: CompileConfig | None = None) -> nn.Module:
    """The tiny GLM model (grouped sigmoid routing, expert bias) with the plan's AC (and compile) applied, no FSDP.
    No nested FSDP unit (none is applied here), so the plan takes an explicit compile_outer."""
    cfg = glm_config(num_layers=2)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, separate_fsdp_unit=False, router_dtype="param"))
    model = build_model(cfg)
    ac = ActivationCheckpointingConfig(mode=ac_mode, replay_routing=replay)
    plan = decide_plan(model, activation_checkpointing=ac, compile=compile_config or CompileConfig())
    apply_ac(model, plan=plan)
    apply_compile(model, plan=plan)
    materialize_and_init(model, device=torch.device("cpu"), seed=0)
    for module in model.modules():  # a nonzero expert bias, so selection and weights differ
        if getattr(module, "e_score_correction_bias", None) is not None:
            module.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, module.num_experts))
    return model


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, 40), generator=g)
    doc = (torch.arange(40) // 9).expand(2, 40).contiguous()
    position_ids = (torch.arange(40) % 9).expand(2, 40).contiguous()
    out = model(ids, position_ids=position_ids, attn=build_attention_inputs(doc))
    out.logits.float().square().mean().backward()
    return {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_the_op_chooses_like_the_reference_and_compiles_without_a_break():
    scores = torch.rand(10, 8)
    bias = torch.linspace(-0.1, 0.1, 8)
    expected = choose_experts(scores, bias, top_k=3, n_group=4, topk_group=2)
    assert torch.equal(select_experts(scores, bias, top_k=3, n_group=4, topk_group=2), expected)
    compiled = torch.compile(
        lambda s, b: select_experts(s, b, top_k=3, n_group=4, topk_group=2), backend="aot_eager", fullgraph=True
    )
    assert torch.equal(compiled(scores, bias), expected)


def test_the_record_replays_in_order_and_names_a_mismatch():
    forward, recompute = routing_replay_context()
    scores = torch.rand(6, 4)
    with forward:
        first = select_experts(scores, None, top_k=2, n_group=1, topk_group=1)
    with recompute:
        assert torch.equal(select_experts(torch.rand(6, 4), None, top_k=2, n_group=1, topk_group=1), first)
        with pytest.raises(RuntimeError, match=r"asked for routing decision 2 but the forward made 1"):
            select_experts(scores, None, top_k=2, n_group=1, topk_group=1)
    record = RoutingRecord()
    record.record(torch.zeros(6, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"decision 1 was \[6, 2\] in the forward and is asked for as \[5, 2\]"):
        record.replay(tokens=5, top_k=2)


@pytest.mark.parametrize(
    ("ac_mode", "compile_config"),
    [
        ("full", None),
        # compile(AC(block)): the context's SAC-policy form makes the partitioner save the choice
        ("full", CompileConfig(enabled=True, backend="aot_eager", layout="compile_outer")),
        ("full", CompileConfig(enabled=True, backend="aot_eager", layout="ac_outer")),  # replayed inside compiled code
        ("selective", None),
    ],
    ids=["full-eager", "full-compile_outer", "full-ac_outer", "selective-eager"],
)
def test_recompute_reuses_the_forward_routing(reroute_in_backward, ac_mode, compile_config):
    reference = grads_of(tiny("none"))
    replayed = grads_of(tiny(ac_mode, compile_config=compile_config))
    assert max_difference(replayed, reference) == 0.0
    assert reroute_in_backward == []  # the router never chose inside backward


@pytest.mark.parametrize(
    "compile_config",
    [None, CompileConfig(enabled=True, backend="aot_eager", layout="compile_outer")],
    ids=["eager", "compile_outer"],  # compile_outer: the compiled backward graph recomputes the choice
)
def test_without_replay_full_ac_reroutes_and_the_gradients_are_silently_wrong(reroute_in_backward, compile_config):
    reference = grads_of(tiny("none"))
    rerouted = grads_of(tiny("full", replay=False, compile_config=compile_config))
    assert len(reroute_in_backward) == 1  # the one MoE block chose again, differently
    assert max_difference(rerouted, reference) > 1e-3


@pytest.mark.slow
def test_selective_ac_over_inductor_compiled_blocks_needs_the_replay(reroute_in_backward):
    """AC(compile(block)) with inductor: the SAC modes recompute each compiled region whole (the router inside it
    included), so the SAC policy alone cannot keep the routing; the replay does."""
    inductor = CompileConfig(enabled=True, backend="inductor", layout="ac_outer")
    reference = grads_of(tiny("none"))
    rerouted = grads_of(tiny("selective", replay=False, compile_config=inductor))
    assert len(reroute_in_backward) == 1 and max_difference(rerouted, reference) > 1e-3
    reroute_in_backward.clear()
    replayed = grads_of(tiny("selective", compile_config=inductor))
    assert reroute_in_backward == [] and max_difference(replayed, reference) < 1e-5
