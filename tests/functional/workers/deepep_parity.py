"""torchrun worker (2 gloo ranks): the DeepEP adapter on ``GlooDeepEPBufferStandIn`` (tests/deepep_standin.py, a
stand-in for ``deep_ep.Buffer``, not DeepEP) against ``backend.dispatcher: torch``. Rank 0 writes JSON to argv[1].

- ``semantics``: the stand-in's dispatch / combine against DeepEP's documented semantics computed here from every
  rank's inputs (one seed): received rows source-rank major in token order, local expert ids with -1 elsewhere,
  weights 0 at -1, the per-expert list, a cached-layout dispatch, combine = the sum over the ranks a token went to,
  a token routed nowhere, and a rank that sends its peer nothing (an empty split);
- ``parity``: the tiny Nemotron-3 model (``tests.factories.nemotron_config``: Mamba, attention and two latent-MoE
  layers, 8 experts top-2) with experts sharded over ep=2, the same weights and per-rank token batches, fp32, for
  (dispatcher torch | deepep stand-in) x (AC none | selective | selective with a policy that leaves the DeepEP ops
  out | full): the loss and every parameter gradient (local expert shards included) against torch / no AC, the max
  absolute difference over both ranks; the stand-in's calls in forward, in backward, and inside the recompute (a
  recompute context composed after the SAC modes counts the calls made while it is entered).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from nemo_ac.config.schema import BackendConfig, ParallelConfig, SelectiveACConfig
from nemo_ac.distributed.activation_checkpointing import (
    PolicyRules,
    SelectivePolicy,
    sac_region_context_fn,
    wrap_block,
)
from nemo_ac.distributed.blocks import decoder_layers, routed_moe
from nemo_ac.distributed.expert_parallel import apply_ep
from nemo_ac.distributed.expert_parallel.deepep_dispatcher import DeepEPDispatcher
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.runtime import destroy_distributed, exit_process
from tests.deepep_standin import GlooDeepEPBufferStandIn
from tests.factories import nemotron_config

FORWARD_KINDS = ("dispatch", "combine")  # the stand-in's call kinds the adapter's forward makes (its backward: none)
SEQ = 32  # never a model dimension of nemotron_config


# --- semantics ------------------------------------------------------------------------------------------------


def semantics(group: dist.ProcessGroup, rank: int) -> dict:
    ranks, num_experts, tokens, hidden = 2, 4, 5, 3
    local = num_experts // ranks
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(ranks)]
    weights = [torch.rand(tokens, 2, generator=gen) for _ in range(ranks)]
    idx = [
        torch.tensor([[0, 1], [1, -1], [-1, -1], [0, 1], [1, 0]]),  # rank 0: own experts only, one token to nobody
        torch.tensor([[3, 0], [2, 3], [1, 2], [-1, 3], [0, 2]]),
    ]
    buffer = GlooDeepEPBufferStandIn(group, 0, 0)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx[rank], num_experts)
    owner = [torch.where(i >= 0, i // local, -1) for i in idx]
    want_in_rank = torch.stack([(owner[rank] == r).any(-1) for r in range(ranks)], dim=1)
    assert torch.equal(in_rank, want_in_rank), (in_rank, want_in_rank)
    assert per_rank.tolist() == want_in_rank.sum(0).tolist() and per_rdma_rank is None
    assert per_expert.tolist() == [int((idx[rank] == e).sum()) for e in range(num_experts)]
    recv_x, recv_idx, recv_w, per_local_expert, handle, _ = buffer.dispatch(
        xs[rank],
        topk_idx=idx[rank],
        topk_weights=weights[rank],
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    )
    # What DeepEP documents: source-rank major, token order, each token once; local ids or -1; weights 0 at -1.
    rows, ids, ws = [], [], []
    for src in range(ranks):
        for t in range(tokens):
            if (owner[src][t] == rank).any():
                mine = owner[src][t] == rank
                rows.append(xs[src][t])
                ids.append(torch.where(mine, idx[src][t] - rank * local, -1))
                ws.append(torch.where(mine, weights[src][t], 0.0))
    assert torch.equal(recv_x, torch.stack(rows)) and torch.equal(recv_idx, torch.stack(ids))
    assert torch.equal(recv_w, torch.stack(ws))
    assert per_local_expert == [int((torch.stack(ids) == e).sum()) for e in range(local)]
    again, none_idx, none_w, none_list, none_handle, _ = buffer.dispatch(xs[rank] * 2, handle=handle)
    assert torch.equal(again, recv_x * 2) and none_idx is none_w is none_list is none_handle is None
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    sent_to = in_rank.sum(dim=1, keepdim=True).to(torch.float32)  # 0 for the token routed nowhere
    torch.testing.assert_close(combined, xs[rank] * sent_to, rtol=0, atol=1e-6)
    assert torch.equal(combined_w, torch.where(idx[rank] >= 0, weights[rank], 0.0))
    return {"received": recv_x.shape[0], "sent": per_rank.tolist(), "calls": dict(buffer.calls)}


# --- parity ---------------------------------------------------------------------------------------------------


class RecomputeCounter:
    """A recompute context (entered only while torch recomputes a checkpointed block) that counts the stand-in's
    forward-kind calls made inside it."""

    def __init__(self) -> None:
        self.buffers = None  # the DeepEP dispatcher's buffer cache, once there is one
        self.calls: collections.Counter[str] = collections.Counter()

    def _snapshot(self) -> collections.Counter[str]:
        buffer = self.buffers.buffer if self.buffers is not None else None
        return collections.Counter(buffer.calls) if buffer is not None else collections.Counter()

    @contextlib.contextmanager
    def _counting(self):
        before = self._snapshot()
        try:
            yield
        finally:
            self.calls += self._snapshot() - before

    def context_fn(self):
        return contextlib.nullcontext(), self._counting()


def build(kind: str, ac: str, ep_mesh, counter: RecomputeCounter):
    cfg = nemotron_config()
    model = build_model(cfg)
    deepep = kind.startswith("deepep")
    plan = decide_plan(
        model,
        model_config=cfg,
        parallel=ParallelConfig(ep=2),
        backend=BackendConfig(dispatcher="deepep" if deepep else kind),
        ep=2,
    )
    apply_ep(model, plan=plan, ep_mesh=ep_mesh, deepep_buffer_cls=GlooDeepEPBufferStandIn if deepep else None)
    blocks = decoder_layers(model)
    moes = [moe for block in blocks if (moe := routed_moe(block)) is not None]
    dispatcher = moes[0].dispatcher
    if kind == "deepep_async":  # as between compiled graphs: every transfer async_finish, the shared expert between
        dispatcher = DeepEPDispatcher(
            group=dispatcher.group,
            num_experts=dispatcher.num_experts,
            between_compiled_graphs=True,
            buffer_cls=GlooDeepEPBufferStandIn,
        )
        for moe in moes:
            moe.set_dispatcher(dispatcher)
    counter.buffers = getattr(dispatcher, "buffers", None)
    if ac != "none":
        rules = PolicyRules.build(SelectiveACConfig())
        if ac == "selective_without_deepep":
            deepep_ops = {torch.ops.nemo_ac.deepep_dispatch, torch.ops.nemo_ac.deepep_combine}
            rules = dataclasses.replace(rules, communication=rules.communication - deepep_ops)
        for index in range(len(blocks)):
            fns = []
            if ac != "full":
                fns.append(
                    sac_region_context_fn(
                        lambda rules=rules, index=index: SelectivePolicy(rules=rules, region=str(index)),
                        region=str(index),
                    )
                )
            blocks[index] = wrap_block(blocks[index], context_fns=[*fns, counter.context_fn])
    materialize_and_init(model, device="cpu", seed=3, family=cfg.family)
    return model, dispatcher


def batch(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 96, (2, SEQ), generator=gen)
    docs = torch.tensor([[0] * 12 + [1] * 20, [0] * 32])
    return ids, torch.arange(SEQ).expand(2, SEQ), build_attention_inputs(docs)


def train_step(kind: str, ac: str, ep_mesh, rank: int) -> dict:
    counter = RecomputeCounter()
    model, dispatcher = build(kind, ac, ep_mesh, counter)
    ids, positions, attn = batch(rank)
    logits = model(ids, position_ids=positions, attn=attn).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    calls = counter.buffers.buffer.calls if counter.buffers is not None else collections.Counter()
    forward = collections.Counter(calls)
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name.replace("_checkpoint_wrapped_module.", "")] = (
            grad.to_local() if hasattr(grad, "to_local") else grad
        ).clone()
    return {
        "loss": loss.detach(),
        "grads": grads,
        "forward": dict(forward),
        "backward": dict(collections.Counter(calls) - forward),
        "recompute": dict(counter.calls),
        "dispatcher": type(dispatcher).__name__,
        "log": list(counter.buffers.buffer.log) if counter.buffers is not None else [],
    }


def max_over_ranks(value: float) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def min_over_ranks(value: float) -> float:
    return -max_over_ranks(-value)


def parity(rank: int) -> list[dict]:
    ep_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    reference = train_step("torch", "none", ep_mesh, rank)
    nonzero = sum(bool(g.abs().max() > 0) for g in reference["grads"].values())
    cells = [{"dispatcher": "torch", "ac": "none", "reference": True, "nonzero_grads": int(min_over_ranks(nonzero))}]
    for kind, ac in [
        ("torch", "selective"),
        ("deepep", "none"),
        ("deepep", "selective"),
        ("deepep", "selective_without_deepep"),
        ("deepep", "full"),
        *(("deepep_async", ac) for ac in ("none", "selective", "selective_without_deepep", "full")),
    ]:
        got = train_step(kind, ac, ep_mesh, rank)
        assert got["grads"].keys() == reference["grads"].keys()
        diffs = {name: float((g - reference["grads"][name]).abs().max()) for name, g in got["grads"].items()}
        cells.append(
            {
                "dispatcher": kind,
                "ac": ac,
                "loss_diff": max_over_ranks(float((got["loss"] - reference["loss"]).abs())),
                "max_grad_diff": max_over_ranks(max(diffs.values())),
                "params_compared": len(diffs),
                "expert_params": sum(".experts." in name for name in diffs),
                "forward_calls": got["forward"],
                "backward_calls": got["backward"],
                "recompute_calls": got["recompute"],
                "adapter": got["dispatcher"],
                "waits": got["log"].count("wait"),
                "async_backward": sum(
                    entry.startswith(("dispatch(handle, ", "combine(topk_weights, ")) for entry in got["log"]
                ),
            }
        )
    return cells


def main(out_path: str) -> int:
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    assert dist.get_world_size() == 2
    result = {"semantics": semantics(group, rank)}
    print(f"rank {rank}: ok semantics", flush=True)
    result["parity"] = parity(rank)
    print(f"rank {rank}: ok parity", flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps(result, indent=1))
    destroy_distributed()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1]))
