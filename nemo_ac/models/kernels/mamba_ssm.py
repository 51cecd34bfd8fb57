"""``backend.mamba: mamba_ssm``: the Mamba-2 core on causal-conv1d + mamba-ssm's Triton chunk scan, as one op.

``mamba_ssm_op`` has ``Mamba2Mixer.ssm_op``'s signature (``nemo_ac.models.layers.mamba2``: inputs before the conv,
``Mamba2CoreParams``) and computes what ``mamba2_ssm`` computes, the way Megatron-Core's and transformers' Mamba-2
layers call the kernels on GPU: one ``causal_conv1d_fn(x, weight, bias, seq_idx=..., activation="silu")`` over the
x / B / C channels (channel-last layout, which ``seq_idx`` needs), then
``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, seq_idx=..., dt_softplus=True,
dt_limit=(dt_min, dt_max))``. Packed documents reach both kernels as ``seq_idx`` (the index of each token's run of
equal document ids, computed from ``attn.document_ids``; with Ulysses CP the full rows' ids, on this rank's heads).

One custom op, ``nemo_ac::mamba_chunk_scan`` (backward ``..._backward``): one node to torch.compile, one op to
selective AC, which saves its output (the recompute never reruns the kernels); its backward runs the kernels'
backward after one more kernel forward (``common.grads_by_rerun``).

CPU: the op's body runs the torch reference (``mamba2_ssm``) for tensors off CUDA, for plumbing tests only; the plan
never installs this op on CPU.
"""

from __future__ import annotations

import torch

from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.kernels.mixer_common import document_runs, grads_by_rerun
from nemo_ac.models.kernels.op_flops import reference_flops, register_op_flops
from nemo_ac.models.layers.mamba2 import Mamba2CoreParams, mamba2_ssm


def _mamba_core(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    conv_x_weight: torch.Tensor,
    conv_x_bias: torch.Tensor,
    conv_b_weight: torch.Tensor,
    conv_b_bias: torch.Tensor,
    conv_c_weight: torch.Tensor,
    conv_c_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    document_ids: torch.Tensor,
    chunk_size: int,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    """causal-conv1d + mamba-ssm (CUDA), or the torch reference for CPU tensors (plumbing tests only)."""
    if x.device.type != "cuda":
        params = Mamba2CoreParams(
            conv_x_weight=conv_x_weight,
            conv_x_bias=conv_x_bias,
            conv_b_weight=conv_b_weight,
            conv_b_bias=conv_b_bias,
            conv_c_weight=conv_c_weight,
            conv_c_bias=conv_c_bias,
            A=A,
            D=D,
            dt_bias=dt_bias,
            chunk_size=chunk_size,
            dt_min=dt_min,
            dt_max=dt_max,
        )
        attn = AttentionInputs(document_ids=document_ids, cu_seqlens=document_ids.new_zeros(0), max_seqlen=0)
        return mamba2_ssm(x, B, C, dt, params, attn)
    from causal_conv1d import causal_conv1d_fn
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    b, s, nh, hd = x.shape
    g, n = B.shape[2], B.shape[3]
    seq_idx = document_runs(document_ids)
    xbc = torch.cat((x.reshape(b, s, -1), B.reshape(b, s, -1), C.reshape(b, s, -1)), dim=-1)
    k = conv_x_weight.shape[-1]
    weight = torch.cat((conv_x_weight.reshape(-1, k), conv_b_weight.reshape(-1, k), conv_c_weight.reshape(-1, k)))
    bias = torch.cat((conv_x_bias.reshape(-1), conv_b_bias.reshape(-1), conv_c_bias.reshape(-1)))
    # [B, D, S] with channels innermost (a transpose of the contiguous [B, S, D]): the layout seq_idx needs.
    xbc = causal_conv1d_fn(
        xbc.transpose(1, 2), weight.to(xbc.dtype), bias.to(xbc.dtype), seq_idx=seq_idx, activation="silu"
    ).transpose(1, 2)
    cx, cb, cc = xbc.split((nh * hd, g * n, g * n), dim=-1)
    y = mamba_chunk_scan_combined(
        cx.reshape(b, s, nh, hd).contiguous(),
        dt.contiguous(),
        A.to(torch.float32),
        cb.reshape(b, s, g, n).contiguous(),
        cc.reshape(b, s, g, n).contiguous(),
        chunk_size=chunk_size,
        D=D.to(torch.float32),
        dt_bias=dt_bias.to(torch.float32),
        seq_idx=seq_idx,
        dt_softplus=True,
        dt_limit=(dt_min, dt_max),
    )
    if isinstance(y, tuple):  # releases that return (out, final_states, ...) here
        y = y[0]
    return y.to(torch.float32)


@torch.library.custom_op("nemo_ac::mamba_chunk_scan", mutates_args=())
def mamba_chunk_scan(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    conv_x_weight: torch.Tensor,
    conv_x_bias: torch.Tensor,
    conv_b_weight: torch.Tensor,
    conv_b_bias: torch.Tensor,
    conv_c_weight: torch.Tensor,
    conv_c_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    document_ids: torch.Tensor,
    chunk_size: int,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    """Mamba-2 core on causal-conv1d + mamba-ssm: x [B, S, nh, hd], B / C [B, S, G, N], dt [B, S, nh] before the
    conv; conv taps and biases per head / group; A, D, dt_bias [nh]. Returns y [B, S, nh, hd] float32."""
    with torch.no_grad():
        return _mamba_core(
            x, B, C, dt, conv_x_weight, conv_x_bias, conv_b_weight, conv_b_bias, conv_c_weight, conv_c_bias, A, D,
            dt_bias, document_ids, chunk_size, dt_min, dt_max,
        ).contiguous()  # fmt: skip


@mamba_chunk_scan.register_fake
def _(x, B, C, dt, *rest):
    return x.new_empty(x.shape, dtype=torch.float32)


_GRADIENT_INPUTS = 13  # x, B, C, dt, the six conv tensors, A, D, dt_bias


@torch.library.custom_op("nemo_ac::mamba_chunk_scan_backward", mutates_args=())
def mamba_chunk_scan_backward(
    grad_out: torch.Tensor,
    tensors: list[torch.Tensor],
    document_ids: torch.Tensor,
    chunk_size: int,
    dt_min: float,
    dt_max: float,
) -> list[torch.Tensor]:
    """Gradients of the 13 differentiable inputs (the kernels' backward after one re-run of their forward)."""

    def forward(*leaves: torch.Tensor) -> torch.Tensor:
        return _mamba_core(*leaves, document_ids, chunk_size, dt_min, dt_max)

    return list(grads_by_rerun(forward, tensors, grad_out))


@mamba_chunk_scan_backward.register_fake
def _(grad_out, tensors, document_ids, chunk_size, dt_min, dt_max):
    return [t.new_empty(t.shape) for t in tensors]


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:_GRADIENT_INPUTS], inputs[_GRADIENT_INPUTS])
    ctx.scalars = inputs[_GRADIENT_INPUTS + 1 :]


def _backward(ctx, grad_out):
    *tensors, document_ids = ctx.saved_tensors
    grads = mamba_chunk_scan_backward(grad_out.contiguous(), tensors, document_ids, *ctx.scalars)
    return (*grads, None, None, None, None)


mamba_chunk_scan.register_autograd(_backward, setup_context=_setup_context)


def mamba_ssm_op(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    params: Mamba2CoreParams,
    attn: AttentionInputs,
) -> torch.Tensor:
    """``Mamba2Mixer.ssm_op`` on causal-conv1d + mamba-ssm (signature in ``nemo_ac.models.layers.mamba2``)."""
    if attn.context_parallel is not None:
        raise RuntimeError(
            "the mamba_ssm Mamba-2 op got a context-parallel sequence shard; the parallelizer must wrap it in the "
            "ulysses op (ring CP runs the torch op)"
        )

    def bias(t: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        return weight.new_zeros(weight.shape[:-1]) if t is None else t  # no bias: zeros (their gradient is dropped)

    p = params
    return mamba_chunk_scan(
        x, B, C, dt,
        p.conv_x_weight, bias(p.conv_x_bias, p.conv_x_weight),
        p.conv_b_weight, bias(p.conv_b_bias, p.conv_b_weight),
        p.conv_c_weight, bias(p.conv_c_bias, p.conv_c_weight),
        p.A, p.D, p.dt_bias, attn.document_ids.to(x.device),
        p.chunk_size, float(p.dt_min), float(p.dt_max),
    )  # fmt: skip


def _reference_run(shapes: tuple, scalars: tuple, *, grad: bool):  # type: ignore[no-untyped-def]
    """nemo_ac's torch Mamba-2 core (segment-masked conv + SSD scan) on inputs of the op's shapes."""
    from types import SimpleNamespace

    def run() -> torch.Tensor:
        *floats, doc = shapes
        t = [torch.empty(shape, requires_grad=grad) for shape in floats]
        chunk, dt_min, dt_max = scalars
        params = Mamba2CoreParams(*t[4:13], chunk_size=chunk, dt_min=dt_min, dt_max=dt_max)
        attn = SimpleNamespace(document_ids=torch.zeros(doc, dtype=torch.int64), context_parallel=None)
        return mamba2_ssm(t[0], t[1], t[2], t[3], params, attn)  # type: ignore[arg-type]

    return run


def _mamba_flops(x, B, C, dt, cxw, cxb, cbw, cbb, ccw, ccb, A, D, dt_bias, document_ids, chunk_size, dt_min, dt_max,
                 *, out_shape: object = None) -> int:  # fmt: skip
    shapes = tuple(tuple(s) for s in (x, B, C, dt, cxw, cxb, cbw, cbb, ccw, ccb, A, D, dt_bias, document_ids))
    scalars = (chunk_size, dt_min, dt_max)
    return reference_flops(("mamba", shapes, scalars), _reference_run(shapes, scalars, grad=False), backward=False)


def _mamba_backward_flops(grad_out, tensors, document_ids, chunk_size, dt_min, dt_max, *,
                          out_shape: object = None) -> int:  # fmt: skip
    """The forward re-run and the backward (what the backward op executes)."""
    shapes = (*(tuple(s) for s in tensors), tuple(document_ids))
    scalars = (chunk_size, dt_min, dt_max)
    return reference_flops(
        ("mamba_backward", shapes, scalars), _reference_run(shapes, scalars, grad=True), backward=True
    )


register_op_flops(torch.ops.nemo_ac.mamba_chunk_scan, _mamba_flops)
register_op_flops(torch.ops.nemo_ac.mamba_chunk_scan_backward, _mamba_backward_flops)
