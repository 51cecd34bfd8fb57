"""DeepEP's dispatch / combine as nemo_ac custom ops, on one gloo rank with the Buffer stand-in
(``tests/deepep_standin.py``): the SAC policy saves them, so a selective recompute makes no DeepEP call (and makes
them again when the policy does not list the ops); handles live exactly as long as tensors name them; torch.compile
traces each op as one node, and under AC(compile(block)) the adapter keeps them between compiled graphs, where the
SAC modes can save them.

Counting: the stand-in counts calls by kind. ``dispatch`` (a new layout) and ``combine`` (no weights) are the
adapter's forward calls; its backward makes only ``dispatch(handle)`` and ``combine(topk_weights)``. So a forward-kind
call made during backward is the recompute communicating again. Two-rank routing and parity with the torch
dispatcher: tests/functional/test_deepep_standin.py.
"""

from __future__ import annotations

import collections
import dataclasses
import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from nemo_ac.config.schema import SelectiveACConfig
from nemo_ac.distributed.activation_checkpointing import (
    PolicyRules,
    SelectivePolicy,
    sac_region_context_fn,
)
from nemo_ac.distributed.expert_parallel import deepep_ops
from nemo_ac.distributed.expert_parallel.deepep_dispatcher import DeepEPDispatcher
from nemo_ac.models.kernels.dispatch import LocalDispatcher
from nemo_ac.models.layers.experts import GroupedExperts
from nemo_ac.workarounds.compiled_regions_under_sac import ac_outer_compile_kwargs
from tests.deepep_standin import GlooDeepEPBufferStandIn

E, H, TOKENS = 4, 8, 10
DEEPEP_OPS = (torch.ops.nemo_ac.deepep_dispatch, torch.ops.nemo_ac.deepep_combine)
FORWARD_KINDS = ("dispatch", "combine")


class TinyMoE(nn.Module):
    """A projection, the dispatcher, grouped experts and combine: the part of an MoE block that communicates."""

    def __init__(self, dispatcher) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.proj = nn.Linear(H, H, bias=False)
        self.experts = GroupedExperts(E, H, 12, impl="grouped_mm")
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.dispatcher = dispatcher

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows, counts, ctx = self.dispatcher.dispatch(self.proj(x), top_idx, E, top_scores=scores)
        return self.dispatcher.combine(self.experts(rows, counts), scores, ctx).sin()


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(0, E, (TOKENS,), generator=gen)
    top_idx = torch.stack((first, (first + 1 + torch.randint(0, E - 1, (TOKENS,), generator=gen)) % E), dim=1)
    return torch.randn(TOKENS, H, generator=gen), top_idx, torch.rand(TOKENS, 2, generator=gen)


def deepep(world, *, between_compiled_graphs: bool = False) -> DeepEPDispatcher:
    return DeepEPDispatcher(
        group=world, num_experts=E, between_compiled_graphs=between_compiled_graphs, buffer_cls=GlooDeepEPBufferStandIn
    )


def run(model: TinyMoE, call=None) -> tuple[dict, dict, list[torch.Tensor]]:
    """Forward + backward; returns (stand-in calls after forward, calls made during backward, [x.grad, scores.grad,
    param grads...])."""
    x, top_idx, scores = inputs()
    x.requires_grad_()
    scores.requires_grad_()
    model.zero_grad()
    out = (call if call is not None else model)(x, top_idx, scores)
    calls = model.dispatcher.buffers.buffer.calls if isinstance(model.dispatcher, DeepEPDispatcher) else {}
    forward = collections.Counter(calls)
    out.pow(2).sum().backward()
    backward = collections.Counter(calls) - forward
    return dict(forward), dict(backward), [x.grad, scores.grad, *(p.grad for p in model.parameters())]


def recompute_calls(backward: dict) -> int:
    return sum(backward.get(kind, 0) for kind in FORWARD_KINDS)


def selective(config: SelectiveACConfig | None = None, *, without_deepep: bool = False):
    rules = PolicyRules.build(config or SelectiveACConfig())
    if without_deepep:
        rules = dataclasses.replace(rules, communication=rules.communication - set(DEEPEP_OPS))
    return sac_region_context_fn(lambda: SelectivePolicy(rules=rules), region="")


def checkpointed(model: TinyMoE, context_fn=None):
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}
    return lambda *args: checkpoint(model, *args, use_reentrant=False, **kwargs)


def assert_exact(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_policy_saves_the_deepep_ops_with_the_collectives() -> None:
    rules = PolicyRules.build(SelectiveACConfig())
    for op in DEEPEP_OPS:
        assert op in rules.communication
        decision, reason = SelectivePolicy(rules=rules).decide(op.default)
        assert decision == CheckpointPolicy.MUST_SAVE, reason
    off = PolicyRules.build(SelectiveACConfig(save_communication=False))
    assert SelectivePolicy(rules=off).decide(DEEPEP_OPS[0].default)[0] == CheckpointPolicy.PREFER_RECOMPUTE


def test_on_one_rank_the_adapter_equals_the_local_dispatcher_and_frees_its_handles(world) -> None:
    _, _, want = run(TinyMoE(LocalDispatcher()))
    forward, backward, got = run(TinyMoE(deepep(world)))
    assert_exact(got, want)
    # Forward: one layout dispatch and one combine; backward: their pairs (combine of the grads, cached dispatch).
    assert forward == {"dispatch": 1, "combine": 1}
    assert backward == {"combine(topk_weights)": 1, "dispatch(handle)": 1}
    gc.collect()
    assert deepep_ops.live_handles() == 0


def test_selective_recompute_makes_no_deepep_call_unless_the_policy_leaves_them_out(world) -> None:
    _, _, want = run(TinyMoE(deepep(world)))
    model = TinyMoE(deepep(world))
    _, backward, got = run(model, checkpointed(model, selective()))
    assert recompute_calls(backward) == 0, backward
    assert_exact(got, want)
    model = TinyMoE(deepep(world))
    _, backward, got = run(model, checkpointed(model, selective(without_deepep=True)))
    assert backward.get("dispatch") == 1 and backward.get("combine") == 1, backward  # the recompute communicates
    assert_exact(got, want)


def test_handles_are_freed_after_full_ac_and_without_grad(world) -> None:
    model = TinyMoE(deepep(world))
    _, backward, _ = run(model, checkpointed(model))  # full AC: the recompute dispatches again, with a new handle
    assert recompute_calls(backward) == 2, backward
    with torch.no_grad():
        model(*inputs())
    gc.collect()
    assert deepep_ops.live_handles() == 0


def _graph_ops(graphs: list[torch.fx.GraphModule]) -> collections.Counter:
    """Call targets by name, overload dropped (Dynamo records the packet, AOT the overload)."""
    return collections.Counter(
        str(node.target).removesuffix(".default")
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "call_function"
    )


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_traces_each_op_as_one_node(world) -> None:
    """fullgraph: the received-token count is an unbacked size (the fake impl), nothing graph-breaks. Dynamo
    traces data-dependent output shapes only with capture_dynamic_output_shape_ops."""
    _, _, want = run(TinyMoE(deepep(world)))
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = TinyMoE(deepep(world))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        _, _, got = run(model, compiled)
    assert len(graphs) == 1
    ops = _graph_ops(graphs)
    assert ops["nemo_ac.deepep_dispatch"] == 1 and ops["nemo_ac.deepep_combine"] == 1, ops
    assert_exact(got, want)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_outer_selective_ac_saves_the_traced_ops(world) -> None:
    """compile(AC(block)): the policy is applied when the checkpoint is traced; the saved ops stay out of the
    backward's recompute."""
    counts = {}
    for without in (False, True):
        model = TinyMoE(deepep(world))
        compiled = torch.compile(checkpointed(model, selective(without_deepep=without)), backend="aot_eager")
        with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
            _, backward, _ = run(model, compiled)
        counts[without] = recompute_calls(backward)
    assert counts == {False: 0, True: 2}


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_ac_outer_needs_the_ops_between_compiled_graphs(world) -> None:
    """AC(compile(block)) with inductor: compiled graphs are recomputed whole (workarounds.compiled_regions_under_sac),
    so ops traced into them communicate again; between graphs the SAC modes save them."""
    counts = {}
    for between in (True, False):
        model = TinyMoE(deepep(world, between_compiled_graphs=between))
        compiled = torch.compile(model, **ac_outer_compile_kwargs({"backend": "inductor"}))
        with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
            _, backward, _ = run(model, checkpointed(compiled, selective()))
        counts[between] = recompute_calls(backward)
    assert counts == {True: 0, False: 2}


def test_the_ops_reject_a_released_buffer_source(world) -> None:
    key = deepep(world).buffers_key  # the dispatcher is dropped at once: its buffers go with it
    gc.collect()
    x, top_idx, scores = inputs()
    with pytest.raises(RuntimeError, match=f"no buffer registered under key {key}"):
        torch.ops.nemo_ac.deepep_dispatch(x, top_idx, scores, key, E)


def test_the_stand_in_refuses_rank_counts_deepep_has_no_config_for(world) -> None:
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks: 6"):
        GlooDeepEPBufferStandIn.get_dispatch_config(6)


OVERLAPPED_BACKWARD = [
    "dispatch(handle, async_finish)", "shared down backward", "wait",
    "combine(topk_weights, async_finish)", "shared up backward", "wait",
]  # fmt: skip


def forward_async() -> list[str]:
    return ["dispatch(async_finish)", "shared up", "wait", "combine(async_finish)", "shared down", "wait"]


def test_between_compiled_graphs_the_shared_expert_runs_while_the_transfers_are_in_flight(world) -> None:
    """Between compiled graphs every transfer is DeepEP's ``async_finish``: ``MoE.forward`` runs the shared
    expert's first projection before ``dispatch_finish`` waits for the dispatch (the received rows are first read
    after the wait), and its ``down_proj`` before ``combine_finish`` waits for the combine. The backward issues each
    transfer from the wait's backward and waits in the op's, with the shared expert's other half between (autograd
    runs nodes newest first). The stand-in logs the calls in order (its events log the waits), module hooks the
    shared expert's forward and backward. Gradients equal the local dispatcher's bitwise, with and without AC."""
    from nemo_ac.config.schema import MoEConfig
    from nemo_ac.models.layers.moe import MoE

    def moe_with(dispatcher) -> MoE:
        moe = MoE(H, MoEConfig(num_experts=E, moe_intermediate_size=12, shared_expert_intermediate_size=6))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        moe.set_dispatcher(dispatcher)
        return moe

    def train(moe: MoE, *, context_fn=None, full_ac: bool = False) -> tuple[list[str], list[str], list]:
        log: list[str] = []
        if isinstance(moe.dispatcher, DeepEPDispatcher):
            moe.dispatcher.buffers.get(torch.empty(1, H))  # the buffer exists: its log is the one to read
            log = moe.dispatcher.buffers.buffer.log
        # Forward hooks: they run once the module has computed (a recompute stopped inside one never gets there).
        moe.shared_expert.up_proj.register_forward_hook(lambda *_: log.append("shared up"))
        moe.shared_expert.down_proj.register_forward_hook(lambda *_: log.append("shared down"))
        moe.shared_expert.up_proj.register_full_backward_hook(lambda *_: log.append("shared up backward"))
        moe.shared_expert.down_proj.register_full_backward_hook(lambda *_: log.append("shared down backward"))
        x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
        call = (lambda t: moe(t)[0]) if not (context_fn or full_ac) else checkpointed(lambda t: moe(t)[0], context_fn)
        out = call(x)
        forward = list(log)
        out.pow(2).sum().backward()
        return forward, log[len(forward) :], [x.grad, *(p.grad for p in moe.parameters())]

    _, _, want = train(moe_with(LocalDispatcher()))
    forward, backward, got = train(moe_with(deepep(world, between_compiled_graphs=True)))
    assert forward == ["dispatch(async_finish)", "shared up", "wait", "combine(async_finish)", "shared down", "wait"]
    # Backward: each transfer issued, the shared expert's other half computed, then the wait.
    assert backward == OVERLAPPED_BACKWARD
    assert_exact(got, want)
    forward, backward, _ = train(moe_with(deepep(world, between_compiled_graphs=False)))
    assert forward == ["dispatch", "combine", "shared up", "shared down"]  # synchronous: the shared expert after
    assert backward == ["shared down backward", "shared up backward", "dispatch(handle)", "combine(topk_weights)"]
    _, backward, got = train(moe_with(deepep(world, between_compiled_graphs=True)), full_ac=True)
    # The recompute runs up to the combine's wait (its node saves the handle): the shared down_proj with it.
    assert backward == [*forward_async(), *OVERLAPPED_BACKWARD]
    assert_exact(got, want)
    _, backward, got = train(moe_with(deepep(world, between_compiled_graphs=True)), context_fn=selective())
    # The saved dispatch, combine and GEMMs are replayed: nothing in flight to wait for.
    assert backward == ["shared up", "shared down", *OVERLAPPED_BACKWARD]
    assert_exact(got, want)
    # save_communication false: the recompute dispatches, overlaps and waits again.
    _, backward, got = train(moe_with(deepep(world, between_compiled_graphs=True)),
                             context_fn=selective(without_deepep=True))  # fmt: skip
    assert backward == [*forward_async(), *OVERLAPPED_BACKWARD]
    assert_exact(got, want)
    assert deepep_ops.transfers_in_flight() == 0
    gc.collect()
    assert deepep_ops.live_handles() == 0
