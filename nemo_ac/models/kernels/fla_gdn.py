"""``backend.linear_attention: fla``: Gated DeltaNet's core on flash-linear-attention's Triton kernels, as one op.

``fla_linear_attn_op`` has ``GatedDeltaNet.linear_attn_op``'s signature (``nemo_ac.models.layers.gated_deltanet``:
inputs before the conv) and computes what ``packed_gated_delta_rule`` computes, the way transformers' Qwen3-Next /
Qwen3.5 layers call fla on GPU: one ``fla.modules.causal_conv1d.causal_conv1d`` (SiLU) over the q / k / v channels,
q / k repeated to the value heads, ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with
``use_qk_l2norm_in_kernel=True`` and the default ``1/sqrt(dk)`` scale. Packed documents reach both kernels as their
own boundary input: the batch is flattened to one row ``[1, B*S, ...]`` and ``cu_seqlens`` marks every run of equal
document ids (computed inside the op from ``attn.document_ids``; with Ulysses CP those are the full rows' ids, and
the op runs on this rank's heads).

The whole core is ONE custom op, ``nemo_ac::fla_gated_delta_rule`` (its backward ``..._backward``), so

- torch.compile traces it as one node (fake impls below; the Triton kernels never meet Dynamo);
- selective AC sees one op and saves its output (``distributed.activation_checkpointing.policy``): the recompute
  never reruns the kernels, and the kernels' internal allocations are never cached or replayed;
- its backward runs fla's backward (``common.grads_by_rerun``: one more fla forward, then fla's backward).

CPU: the op's body runs the torch reference (``packed_gated_delta_rule``) for tensors off CUDA. The plan never
installs this op on CPU (validation refuses ``fla`` there); that path exists so the op's plumbing (registration,
autograd, compile, SAC) is tested on machines without a GPU, labeled as such in the tests.
"""

from __future__ import annotations

import torch

from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.kernels.gated_delta_rule import ConvWeights, packed_gated_delta_rule
from nemo_ac.models.kernels.mixer_common import cu_seqlens_of, grads_by_rerun
from nemo_ac.models.kernels.op_flops import reference_flops, register_op_flops

_CPU_REFERENCE_CHUNK = 64


def _fla_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    document_ids: torch.Tensor,
) -> torch.Tensor:
    """fla's conv + gated delta rule (CUDA), or the torch reference for CPU tensors (plumbing tests only)."""
    if q.device.type != "cuda":
        attn = AttentionInputs(document_ids=document_ids, cu_seqlens=document_ids.new_zeros(0), max_seqlen=0)
        return packed_gated_delta_rule(q, k, v, g, beta, (wq, wk, wv), attn, chunk_size=_CPU_REFERENCE_CHUNK)
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    b, s, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    tokens = b * s
    cu_seqlens = cu_seqlens_of(document_ids)
    mixed = torch.cat((q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1)), dim=-1)
    weight = torch.cat((wq.reshape(hk * dk, -1), wk.reshape(hk * dk, -1), wv.reshape(hv * dv, -1)), dim=0)
    mixed, _ = causal_conv1d(
        mixed.reshape(1, tokens, -1), weight=weight.to(mixed.dtype), activation="silu", cu_seqlens=cu_seqlens
    )
    cq, ck, cv = mixed.split((hk * dk, hk * dk, hv * dv), dim=-1)
    cq, ck = cq.reshape(1, tokens, hk, dk), ck.reshape(1, tokens, hk, dk)
    cv = cv.reshape(1, tokens, hv, dv)
    if hv > hk:  # value head i reads key head i // (Hv/Hk), as in the torch op
        cq, ck = cq.repeat_interleave(hv // hk, dim=2), ck.repeat_interleave(hv // hk, dim=2)
    out, _ = chunk_gated_delta_rule(
        cq.contiguous(),
        ck.contiguous(),
        cv.contiguous(),
        g.reshape(1, tokens, hv).to(torch.float32),
        beta.reshape(1, tokens, hv).to(cv.dtype),
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
    )
    return out.reshape(b, s, hv, dv).to(v.dtype)


@torch.library.custom_op("nemo_ac::fla_gated_delta_rule", mutates_args=())
def fla_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    document_ids: torch.Tensor,
) -> torch.Tensor:
    """Gated DeltaNet core on fla: q, k [B, S, Hk, dk], v [B, S, Hv, dv] before the conv; g, beta [B, S, Hv]; the
    conv taps per head; document_ids [B, S]. Returns [B, S, Hv, dv] in v's dtype."""
    with torch.no_grad():
        return _fla_core(q, k, v, g, beta, wq, wk, wv, document_ids).contiguous()  # the fake's layout


@fla_gated_delta_rule.register_fake
def _(q, k, v, g, beta, wq, wk, wv, document_ids):
    return v.new_empty(v.shape)


@torch.library.custom_op("nemo_ac::fla_gated_delta_rule_backward", mutates_args=())
def fla_gated_delta_rule_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    document_ids: torch.Tensor,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """Gradients of q, k, v, g, beta, wq, wk, wv (fla's backward after one re-run of its forward)."""

    def forward(*tensors: torch.Tensor) -> torch.Tensor:
        return _fla_core(*tensors, document_ids)

    return grads_by_rerun(forward, (q, k, v, g, beta, wq, wk, wv), grad_out)  # type: ignore[return-value]


@fla_gated_delta_rule_backward.register_fake
def _(grad_out, q, k, v, g, beta, wq, wk, wv, document_ids):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, g, beta, wq, wk, wv))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_out):
    *tensors, document_ids = ctx.saved_tensors
    grads = fla_gated_delta_rule_backward(grad_out.contiguous(), *tensors, document_ids)
    return (*grads, None)


fla_gated_delta_rule.register_autograd(_backward, setup_context=_setup_context)


def fla_linear_attn_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weights: ConvWeights,
    attn: AttentionInputs,
) -> torch.Tensor:
    """``GatedDeltaNet.linear_attn_op`` on fla (signature in ``nemo_ac.models.layers.gated_deltanet``)."""
    if attn.context_parallel is not None:
        raise RuntimeError(
            "the fla Gated DeltaNet op got a context-parallel sequence shard; the parallelizer must wrap it in the "
            "ulysses op (ring CP runs the torch op)"
        )
    wq, wk, wv = conv_weights
    return fla_gated_delta_rule(q, k, v, g, beta, wq, wk, wv, attn.document_ids.to(q.device))


def _reference_run(shapes: tuple, *, grad: bool):  # type: ignore[no-untyped-def]
    """nemo_ac's torch Gated DeltaNet core on inputs of the fla op's shapes (chunk 64, fla's own)."""
    from types import SimpleNamespace

    from nemo_ac.models.kernels.gated_delta_rule import packed_gated_delta_rule

    def run() -> torch.Tensor:
        *floats, doc = shapes
        tensors = [torch.empty(shape, requires_grad=grad) for shape in floats]
        q, k, v, g, beta, wq, wk, wv = tensors
        attn = SimpleNamespace(document_ids=torch.zeros(doc, dtype=torch.int64), context_parallel=None)
        return packed_gated_delta_rule(q, k, v, g, beta, (wq, wk, wv), attn, chunk_size=64)  # type: ignore[arg-type]

    return run


def _fla_flops(q, k, v, g, beta, wq, wk, wv, document_ids, *, out_shape: object = None) -> int:
    shapes = tuple(tuple(s) for s in (q, k, v, g, beta, wq, wk, wv, document_ids))
    return reference_flops(("fla_gdn", shapes), _reference_run(shapes, grad=False), backward=False)


def _fla_backward_flops(grad_out, q, k, v, g, beta, wq, wk, wv, document_ids, *, out_shape: object = None) -> int:
    """The forward re-run and the backward (what the backward op executes)."""
    shapes = tuple(tuple(s) for s in (q, k, v, g, beta, wq, wk, wv, document_ids))
    return reference_flops(("fla_gdn_backward", shapes), _reference_run(shapes, grad=True), backward=True)


register_op_flops(torch.ops.nemo_ac.fla_gated_delta_rule, _fla_flops)
register_op_flops(torch.ops.nemo_ac.fla_gated_delta_rule_backward, _fla_backward_flops)
