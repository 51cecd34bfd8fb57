"""nemo_ac's own AC(compile(block)) path (``apply_ac`` + ``apply_compile``, full AC, the tiny Qwen3-MoE block):
without the forward-thread context a recompute that compiles on the backward thread breaks training, with it the
recompute compiles once and matches the forward.

The recompute misses the forward's cache entry (the worker thread sets another intra-op thread count, part of
Dynamo's global-state guard; on GPU the autograd device thread's count differs the same way). Compiling there with
the thread's defaults, ``capture_scalar_outputs=False`` graph-breaks at the experts' ``tokens_per_expert.tolist()``,
the recompute runs other graphs than the forward, and even plain AC fails (torch 2.13)::

    torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the following tensors
    have different metadata than during the forward pass.

Backend ``aot_eager``: the partitioned AOTAutograd graphs decide what the compiled forward saves (what the
failure compares) and it compiles in seconds; nemo_ac's functional test runs the same layout with inductor.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointError

from nemo_ac.config.schema import ActivationCheckpointingConfig, CompileConfig, ModelConfig, MoEConfig
from nemo_ac.diagnostics.recompiles import CompileAccounting
from nemo_ac.distributed.activation_checkpointing import apply_ac
from nemo_ac.distributed.compile import apply_compile
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs

SEQ = 44  # no model dimension equals it (duck sizing would tie them)


pytestmark = [pytest.mark.workaround, pytest.mark.usefixtures("fresh_dynamo")]


def tiny_ac_outer(*, forward_thread_context: bool) -> torch.nn.Module:
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        num_layers=1,
        # the loop: its tokens_per_expert.tolist() is what graph-breaks under the backward thread's defaults
        moe=MoEConfig(num_experts=4, moe_intermediate_size=32, experts_impl="loop"),
    )
    compile_config = CompileConfig(
        enabled=True, backend="aot_eager", layout="ac_outer", forward_thread_context=forward_thread_context
    )
    ac = ActivationCheckpointingConfig(mode="full")
    model = build_model(cfg)
    plan = decide_plan(model, compile=compile_config, activation_checkpointing=ac)
    apply_ac(model, plan=plan)
    apply_compile(model, plan=plan)
    materialize_and_init(model, device=torch.device("cpu"), seed=0)
    return model


def step(model: torch.nn.Module, seed: int) -> float:
    """Forward here, backward on a worker thread that misses the forward's cache entry."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, SEQ), generator=g)
    doc = (torch.arange(SEQ) // 7).expand(2, SEQ).contiguous()
    pos = (torch.arange(SEQ) % 7).expand(2, SEQ).contiguous()
    loss = model(ids, position_ids=pos, attn=build_attention_inputs(doc)).logits.float().square().mean()
    main_threads = torch.get_num_threads()
    errors: list[BaseException] = []

    def backward() -> None:
        torch.set_num_threads(1 if main_threads != 1 else 2)
        try:
            loss.backward()
        except BaseException as exc:
            errors.append(exc)
        finally:
            torch.set_num_threads(main_threads)

    worker = threading.Thread(target=backward, name="test-backward")
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
    return loss.item()


def test_without_the_forward_thread_context_the_recompute_graph_breaks_and_ac_fails():
    model = tiny_ac_outer(forward_thread_context=False)
    failure = "Recomputed values for the following tensors have different metadata"
    with CompileAccounting() as accounting, pytest.raises(CheckpointError, match=failure):
        step(model, seed=0)
    assert accounting.threads["fwd"].graph_breaks == 0  # tolist() traced (capture_scalar_outputs=True)
    assert accounting.threads["bwd"].graph_breaks > 0  # the default False: a graph break at tolist()


def test_with_it_the_recompute_compiles_the_forwards_graph_once_on_the_backward_thread():
    model = tiny_ac_outer(forward_thread_context=True)
    grads = []
    with CompileAccounting() as accounting:
        for seed in (0, 1):
            step(model, seed=seed)
            grads.append(model.lm_head.weight.grad.clone())
            model.zero_grad(set_to_none=True)
        m = accounting.metrics()
    assert (m["compiles_fwd"], m["compiles_bwd"], m["graph_breaks"], m["eager_fallbacks"]) == (1, 1, 0, 0)
    assert all("num_threads" in reason for reason in accounting.threads["bwd"].reasons)
    assert counters["stats"]["unique_graphs"] == 2  # the block: once per thread, reused by the second step
    assert not torch.equal(grads[0], grads[1])
