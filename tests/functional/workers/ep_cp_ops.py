"""torchrun worker (2 gloo ranks): the EP and CP ops against one-process references, values and gradients.

Every rank builds the same full inputs from one seed, computes the single-process reference on all of them, then
runs the distributed op on its own share and compares its share of outputs and gradients (fp64, so any mismatch is
a bug, not rounding). Checks:

- ``ep``: all-to-all dispatch/combine over 2 ranks with uneven splits: rank 0 routes only to its own experts (it
  sends the peer nothing), expert 3 gets no token at all;
- ``ulysses``: kv heads split (nkv=2) and replicated (nkv=1 < cp=2), packed documents with padding;
- ``ring``: head-tail shards, packed documents (one spanning every chunk), padding, GQA;
- ``ring_compiled``: the ring op under ``torch.compile(fullgraph=True)`` (no graph break: no data-dependent Python
  branch) equals eager, values and gradients;
- ``ulysses_linear_attention`` / ``ulysses_mamba``: a whole Gated DeltaNet / Mamba-2 mixer (fp32 math inside, so fp32
  tolerances) with its op wrapped by Ulysses on a sequence shard equals the mixer on the full rows: outputs, input
  gradients and parameter gradients (summed over ranks, as FSDP does); Mamba with 1 B/C group < cp (replicated).

Prints ``rank R: ok <check>`` per check; exits non-zero with the traceback on the first failure.
"""

from __future__ import annotations

import copy
import functools
import sys

import torch
import torch.distributed as dist

from nemo_ac.config.schema import LinearAttentionConfig, MambaConfig
from nemo_ac.distributed.context_parallel.ring import ring_attention
from nemo_ac.distributed.context_parallel.sharding import (
    ring_attention_inputs,
    shard_positions,
    ulysses_attention_inputs,
)
from nemo_ac.distributed.context_parallel.ulysses import ulysses_attention, ulysses_linear_attention, ulysses_ssm
from nemo_ac.distributed.expert_parallel import AllToAllDispatcher
from nemo_ac.models.init import init_weights
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.kernels.dispatch import LocalDispatcher
from nemo_ac.models.layers.attention import packed_causal_attention
from nemo_ac.models.layers.experts import GroupedExperts
from nemo_ac.models.layers.gated_deltanet import GatedDeltaNet
from nemo_ac.models.layers.mamba2 import Mamba2Mixer
from nemo_ac.models.mixer_kernels import fla_linear_attn_op, mamba_ssm_op
from nemo_ac.runtime import destroy_distributed, exit_process
from tests.parity import TOLERANCES

DTYPE = torch.float64


FP64 = TOLERANCES["float64"].grad  # the parity table's fp64 bound
FP32 = TOLERANCES["float32"].grad


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=FP64, atol=FP64 / 100, msg=lambda m: f"{what}: {m}")


def check_ep(group: dist.ProcessGroup, rank: int) -> None:
    num_experts, hidden, inter, tokens = 4, 12, 6, 9
    gen = torch.Generator().manual_seed(11)
    full_experts = GroupedExperts(num_experts, hidden, inter).to(DTYPE)
    with torch.no_grad():
        for p in full_experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DTYPE) * 0.3)
    x = torch.randn(2 * tokens, hidden, generator=gen, dtype=DTYPE)
    scores = torch.rand(2 * tokens, 2, generator=gen, dtype=DTYPE)
    weights = torch.randn(2 * tokens, hidden, generator=gen, dtype=DTYPE)
    # Rank 0's tokens use experts 0/1 only (its own: nothing goes to rank 1); rank 1's use 0, 1, 2; never 3.
    top_idx = torch.cat(
        (
            torch.tensor([[0, 1], [1, 0]]).repeat(5, 1)[:tokens],
            torch.tensor([[2, 0], [1, 2], [2, 1]]).repeat(3, 1)[:tokens],
        )
    )
    ref_x, ref_s = x.clone().requires_grad_(), scores.clone().requires_grad_()
    local = LocalDispatcher()
    rows, counts, ctx = local.dispatch(ref_x, top_idx, num_experts)
    ref_out = local.combine(full_experts(rows, counts), ref_s, ctx)
    (ref_out * weights).sum().backward()

    mine = slice(rank * tokens, (rank + 1) * tokens)
    experts = GroupedExperts(num_experts // 2, hidden, inter).to(DTYPE)
    with torch.no_grad():
        experts.gate_up_proj.copy_(full_experts.gate_up_proj[2 * rank : 2 * rank + 2])
        experts.down_proj.copy_(full_experts.down_proj[2 * rank : 2 * rank + 2])
    my_x, my_s = x[mine].clone().requires_grad_(), scores[mine].clone().requires_grad_()
    dispatcher = AllToAllDispatcher(group=group, num_experts=num_experts)
    rows, counts, ctx = dispatcher.dispatch(my_x, top_idx[mine], num_experts, top_scores=my_s)
    if rank == 0:
        assert ctx.send_splits == [tokens * 2, 0], ctx.send_splits  # nothing for rank 1
    out = dispatcher.combine(experts(rows, counts), my_s, ctx)
    (out * weights[mine]).sum().backward()
    close(out, ref_out[mine], "ep output")
    close(my_x.grad, ref_x.grad[mine], "ep hidden grad")
    close(my_s.grad, ref_s.grad[mine], "ep score grad")
    close(experts.gate_up_proj.grad, full_experts.gate_up_proj.grad[2 * rank : 2 * rank + 2], "ep gate_up grad")
    close(experts.down_proj.grad, full_experts.down_proj.grad[2 * rank : 2 * rank + 2], "ep down grad")
    if rank == 1:
        assert torch.all(experts.down_proj.grad[1] == 0)  # expert 3: no token anywhere


def packed_docs(seq_len: int) -> torch.Tensor:
    """Two rows: short documents then padding; one long document across every chunk then a short one."""
    first = [0] * 3 + [1] * 7 + [2] * 2 + [3] * (seq_len - 15) + [-1] * 3
    second = [0] * (seq_len - 5) + [1] * 5
    return torch.tensor([first, second])


def attention_case(seq_len: int, num_kv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq_len, 4, 8, generator=gen, dtype=DTYPE)
    k = torch.randn(2, seq_len, num_kv, 8, generator=gen, dtype=DTYPE)
    v = torch.randn(2, seq_len, num_kv, 8, generator=gen, dtype=DTYPE)
    grad = torch.randn(2, seq_len, 4, 8, generator=gen, dtype=DTYPE)
    return q, k, v, grad


def reference_attention(q, k, v, grad, docs):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = packed_causal_attention(q, k, v, AttentionInputs(document_ids=docs, cu_seqlens=torch.zeros(1), max_seqlen=0))
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def run_sharded(op, q, k, v, grad, attn: AttentionInputs, pos: torch.Tensor):
    q, k, v = (t[:, pos].clone().requires_grad_() for t in (q, k, v))
    out = op(q, k, v, attn)
    out.backward(grad[:, pos])
    return out.detach(), q.grad, k.grad, v.grad


def check_attention(kind: str, group: dist.ProcessGroup, rank: int, *, num_kv: int, compiled: bool = False) -> None:
    seq_len = 40  # ring: 4 chunks of 10; never a model dimension
    docs = packed_docs(seq_len)
    q, k, v, grad = attention_case(seq_len, num_kv, seed=3 + num_kv)
    want = reference_attention(q, k, v, grad, docs)
    pos = shard_positions(seq_len, cp_size=2, cp_rank=rank, cp_type=kind)
    local_docs = docs[:, pos].to(torch.int32)
    if kind == "ring":
        meta = ring_attention_inputs(docs, cp_size=2, cp_rank=rank)
        op = functools.partial(ring_attention, group=group, cp_rank=rank, cp_size=2)
    else:
        meta = ulysses_attention_inputs(docs)
        op = functools.partial(ulysses_attention, inner=packed_causal_attention, group=group, cp_size=2)
    if compiled:
        op = torch.compile(op, backend="aot_eager", fullgraph=True)
    attn = AttentionInputs(document_ids=local_docs, cu_seqlens=torch.zeros(1), max_seqlen=0, context_parallel=meta)
    got = run_sharded(op, q, k, v, grad, attn, pos)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        close(g, w[:, pos], f"{kind} nkv={num_kv} compiled={compiled} {name}")


def check_mixer(kind: str, group: dist.ProcessGroup, rank: int, *, kernel_op: bool = False) -> None:
    """A recurrent mixer under Ulysses CP equals the mixer on the full rows (outputs and every gradient).

    ``kernel_op``: Ulysses wraps the mixer kernel's custom op (``backend.linear_attention: fla`` / ``backend.mamba:
    mamba_ssm``) instead of the torch op. On CPU that op's body is the torch reference, so this checks that the
    wrapper hands the op what it needs (full rows' document ids, this rank's conv taps / params) and that the op's
    backward composes with the all-to-alls; the kernels themselves are checked on a GPU."""
    hidden, seq_len = 24, 40
    if kind == "linear_attention":
        cfg = LinearAttentionConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, chunk_size=8)
        full, attr, wrapper = GatedDeltaNet(hidden, cfg), "linear_attn_op", ulysses_linear_attention
    else:
        cfg = MambaConfig(num_heads=4, head_dim=6, state_size=8, n_groups=1, chunk_size=8)
        full, attr, wrapper = Mamba2Mixer(hidden, cfg), "ssm_op", ulysses_ssm
    init_weights(full, seed=3, init_std=0.2, family="qwen3_5_moe")
    sharded = copy.deepcopy(full)
    inner = getattr(full, attr)
    if kernel_op:
        inner = fla_linear_attn_op if kind == "linear_attention" else mamba_ssm_op
    setattr(sharded, attr, functools.partial(wrapper, inner=inner, group=group, cp_size=2, cp_rank=rank))
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, seq_len, hidden, generator=gen)
    grad = torch.randn(2, seq_len, hidden, generator=gen)
    docs = packed_docs(seq_len)

    ref_x = x.clone().requires_grad_()
    ref = full(ref_x, attn=AttentionInputs(document_ids=docs, cu_seqlens=torch.zeros(1), max_seqlen=0))
    ref.backward(grad)

    pos = shard_positions(seq_len, cp_size=2, cp_rank=rank, cp_type="ulysses")
    my_x = x[:, pos].clone().requires_grad_()
    attn = AttentionInputs(
        document_ids=docs[:, pos],
        cu_seqlens=torch.zeros(1),
        max_seqlen=0,
        context_parallel=ulysses_attention_inputs(docs),
    )
    out = sharded(my_x, attn=attn)
    out.backward(grad[:, pos])
    tol = {"rtol": FP32, "atol": FP32 / 10}
    if kernel_op:  # the op's backward sums dx's q / k / v paths in another order than one autograd graph (fp32)
        tol = {"rtol": 10 * FP32, "atol": FP32}
    torch.testing.assert_close(out, ref.detach()[:, pos], **tol, msg=lambda m: f"{kind} out: {m}")
    torch.testing.assert_close(my_x.grad, ref_x.grad[:, pos], **tol, msg=lambda m: f"{kind} dx: {m}")
    for (name, p_ref), p_cp in zip(full.named_parameters(), sharded.parameters()):
        summed = p_cp.grad.clone()
        dist.all_reduce(summed, group=group)
        # A weight gradient sums over tokens in another order than one process: compare as a whole (fp32 math).
        error = float((summed - p_ref.grad).norm() / p_ref.grad.norm().clamp_min(1e-30))
        limit = 1e-4 if kernel_op else 1e-5  # kernel_op: another summation order again (see tol above)
        assert error < limit, f"{kind} grad {name}: relative error {error:.2e}"


def main() -> int:
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    assert dist.get_world_size() == 2
    checks = [
        ("ep", lambda: check_ep(group, rank)),
        ("ulysses nkv=2", lambda: check_attention("ulysses", group, rank, num_kv=2)),
        ("ulysses nkv=1", lambda: check_attention("ulysses", group, rank, num_kv=1)),
        ("ring", lambda: check_attention("ring", group, rank, num_kv=2)),
        ("ring_compiled", lambda: check_attention("ring", group, rank, num_kv=2, compiled=True)),
        ("ulysses_linear_attention", lambda: check_mixer("linear_attention", group, rank)),
        ("ulysses_mamba", lambda: check_mixer("mamba", group, rank)),
        ("ulysses_fla_op", lambda: check_mixer("linear_attention", group, rank, kernel_op=True)),
        ("ulysses_mamba_ssm_op", lambda: check_mixer("mamba", group, rank, kernel_op=True)),
    ]
    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None
    for name, check in checks:
        if only is None or name.split()[0] in only:
            check()
            print(f"rank {rank}: ok {name}", flush=True)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    exit_process(main())
