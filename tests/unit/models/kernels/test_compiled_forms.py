"""Inside a compiled graph the memory-saving ``autograd.Function`` forms (document-masked conv, weighted combine,
fp32 router linear) give way to their autograd forms: a custom ``autograd.Function`` in a graph makes torch 2.13
bypass AOTAutograd's cache for that whole graph (``autograd_cache_bypass``), so a warm start re-traced the Gated
DeltaNet and MoE block graphs (make run's first block graph 9 -> 27 s warm). Eagerly they keep their forms."""

from __future__ import annotations

import torch

from nemo_ac.config.schema import MoEConfig
from nemo_ac.models.kernels.dispatch import weighted_combine
from nemo_ac.models.kernels.gated_delta_rule import packed_causal_conv1d
from nemo_ac.models.layers.router import TopKRouter


def _captured_graph(fn, *args) -> str:
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch.compiler.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    out.float().sum().backward()
    assert len(graphs) == 1
    return graphs[0]


def _conv(x, weight, ids):
    return packed_causal_conv1d(x, weight, ids)


def test_compiled_graphs_hold_no_autograd_function():
    x = torch.randn(1, 12, 2, 4, requires_grad=True)
    weight = torch.randn(2, 4, 4, requires_grad=True)
    ids = torch.tensor([[0] * 5 + [1] * 7])
    rows = torch.randn(12, 8, dtype=torch.bfloat16, requires_grad=True)
    scores = torch.rand(6, 2, requires_grad=True)
    router = TopKRouter.from_config(8, MoEConfig(num_experts=4, num_experts_per_tok=2, router_dtype="float32"))
    hidden = torch.randn(6, 8, dtype=torch.bfloat16, requires_grad=True)
    for fn, args in ((_conv, (x, weight, ids)), (weighted_combine, (rows, scores)), (router.logits, (hidden,))):
        graph = _captured_graph(fn, *args)
        assert "autograd_function_apply" not in graph, (fn, graph)


def test_eager_calls_keep_the_memory_saving_forms():
    rows = torch.randn(12, 8, dtype=torch.bfloat16, requires_grad=True)
    out = weighted_combine(rows, torch.rand(6, 2, requires_grad=True))
    assert type(out.grad_fn).__name__ == "_WeightedCombineBackward"
