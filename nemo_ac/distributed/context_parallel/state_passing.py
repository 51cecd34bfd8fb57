"""Ring context parallel for the recurrent mixers (Gated DeltaNet, Mamba-2): state passing between sequence slices.

Under ``cp_type: ring`` a rank holds two head-tail slices of ``c = S / (2 cp)`` tokens: global slices ``r`` and
``2cp-1-r`` (``sharding``). Both recurrences are affine in their state, so a slice's outputs split into what the
slice computes from a zero state and what the state carried into it adds::

    out(S_in) = out(0) + correction(S_in)        S_end = T S_in + F

Each rank runs its two slices (stacked on the batch dim) once from a zero state and gets, per slice, the final
state ``F`` (only the slice's last document) and the slice's transition ``T``. One differentiable all-gather
gives every rank all ``2 cp`` pairs ``(F, T)``; a scan over the slices in global order gives the state carried
into each of this rank's two slices; the correction adds it. The gradient of the carried state flows back through
the all-gather (its backward is a reduce-scatter) to the ranks that produced it. The conv's ``K-1`` halo tokens
(pre-conv inputs of the previous global slice) travel in a second, tiny all-gather with the same backward.

- Gated DeltaNet: ``T`` is a ``[dk, dk]`` matrix per head, the product of ``exp(g_t) (I - beta_t k_t k_t^T)``.
  State columns evolve independently, so the scan runs once over ``dv + dk`` value columns: ``[v | 0]`` from the
  initial state ``[0 | I]``. The extra columns end at ``T`` and output ``o_T[t] = T_t^T q_t``, so the correction
  is ``o_T[t] @ S_in`` (``T_t`` the transition from the slice start to ``t``).
- Mamba-2: ``T`` is a scalar per head, ``exp(sum a)``; the correction is ``exp(cumsum a)_t C_t . S_in``.

Documents stop the carry exactly: document starts come from the full rows' ``document_ids``
(``RingAttentionInputs``, no communication), so a slice whose position 0 starts a document reads nothing carried;
``T = 0`` for a slice holding a document start (the chunked ops reset the state there) and ``F`` holds only the
last document. Tensor ops and functional collectives only (no ``.item()``, no data-dependent branching): one
compiled graph across packed layouts, and selective AC saves the collectives' outputs
(``activation_checkpointing.policy``), so a recompute does not communicate.

Bytes a rank contributes per layer (fp32 state, B rows): GDN ``2 B Hv dk (dv + dk) 4``, Mamba-2
``2 B nh (hd N + 1) 4``, plus the halo's ``2 B (K-1) C_conv`` activations; a ring all-gather sends ``cp - 1``
such pieces per rank. That does not grow with the sequence, while ring attention sends ``cp - 1`` K/V blocks of
``S / cp`` tokens (``benchmarks/cp_state_bytes.py``; the table is in docs/parallelism.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from nemo_ac.distributed.context_parallel.sharding import RingAttentionInputs, head_tail_positions
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.kernels.gated_delta_rule import (
    ConvWeights,
    accumulation_dtype,
    chunk_gated_delta_rule,
    l2norm,
    packed_causal_conv1d,
)
from nemo_ac.models.layers.mamba2 import Mamba2CoreParams, causal_depthwise_conv1d, ssd_chunk_scan


def _ring_meta(attn: AttentionInputs, kind: str) -> RingAttentionInputs:
    meta = attn.context_parallel
    if not isinstance(meta, RingAttentionInputs):
        raise TypeError(
            f"ring context-parallel {kind} needs RingAttentionInputs in attn.context_parallel (the trainer's CP "
            f"batch preparer builds it for parallel.cp_type: ring); got {type(meta).__name__}"
        )
    return meta


def _local_slices(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """Global slice indices this rank holds, in local order (head, tail)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _to_slices(t: torch.Tensor) -> torch.Tensor:
    """[B, 2c, *rest] (this rank's head and tail slices) -> [2B, c, *rest], slice-major."""
    b, length = t.shape[:2]
    return t.reshape(b, 2, length // 2, *t.shape[2:]).transpose(0, 1).reshape(2 * b, length // 2, *t.shape[2:])


def _from_slices(t: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_to_slices``."""
    b2, c = t.shape[:2]
    return t.reshape(2, b2 // 2, c, *t.shape[2:]).transpose(0, 1).reshape(b2 // 2, 2 * c, *t.shape[2:])


def gather_slices(x: torch.Tensor, *, group: dist.ProcessGroup | str, cp_size: int) -> torch.Tensor:
    """[2, ...] (this rank's head, tail) -> [2 cp, ...] in global slice order; differentiable (the backward
    reduce-scatters every slice's gradient to its owner)."""
    gathered = funcol.all_gather_single_autograd(x.contiguous(), 0, group)  # [cp * 2, ...], rank-major
    order = [2 * j if j < cp_size else 2 * (2 * cp_size - 1 - j) + 1 for j in range(2 * cp_size)]
    return gathered[order]


class SliceLayout:
    """Per local slice (stacked ``[2B, ...]``): global document starts, and run ids with the conv halo in front.

    ``starts`` [2B, c]: True where a document starts (position 0 of a slice only if the previous global token is
    in another run). ``runs`` [2B, halo + c]: index of the run of equal document ids each position is in (as the
    single-sequence ops define documents); halo positions before the sequence start get run 0, which no token has.
    """

    def __init__(self, document_ids: torch.Tensor, *, cp_size: int, cp_rank: int, halo: int) -> None:
        b, s = document_ids.shape
        c = s // (2 * cp_size)
        if c < halo:
            raise ValueError(
                f"ring CP slices of {c} tokens are shorter than the conv halo ({halo} = conv_kernel - 1); use a "
                f"longer sequence or fewer CP ranks"
            )
        device = document_ids.device
        change = document_ids[:, 1:] != document_ids[:, :-1]
        starts = torch.cat((torch.ones_like(change[:, :1]), change), dim=1)
        runs = starts.to(torch.int32).cumsum(dim=1)  # >= 1
        local = head_tail_positions(c, cp_size=cp_size, cp_rank=cp_rank, device=device)
        self.starts = _to_slices(starts.index_select(1, local))
        halo_pos = local.view(2, c)[:, :1] - halo + torch.arange(halo, device=device)  # [2, halo]
        halo_runs = runs.index_select(1, halo_pos.clamp(min=0).reshape(-1)).view(b, 2, halo).transpose(0, 1)
        halo_runs = halo_runs.masked_fill((halo_pos < 0)[:, None, :], 0).reshape(2 * b, halo)
        self.runs = torch.cat((halo_runs, _to_slices(runs.index_select(1, local))), dim=1)
        self.halo = halo


def _with_halo(
    packed: torch.Tensor, *, halo: int, group: dist.ProcessGroup | str, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """[B, 2c, F] pre-conv channels -> [2B, halo + c, F]: each local slice with the last ``halo`` tokens of the
    previous global slice in front (zeros before the sequence start)."""
    b, length, feat = packed.shape
    c = length // 2
    slices = packed.reshape(b, 2, c, feat).transpose(0, 1)  # [2, B, c, F]
    tails = gather_slices(slices[:, :, c - halo :], group=group, cp_size=cp_size)  # [2cp, B, halo, F]
    previous = torch.cat((torch.zeros_like(tails[:1]), tails[:-1]), dim=0)  # previous[j]: tail of slice j-1
    mine = previous[list(_local_slices(cp_size, cp_rank))]
    return torch.cat((mine, slices), dim=2).reshape(2 * b, halo + c, feat)


def _carried_states(final: torch.Tensor, step, *, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Scan the gathered per-slice finals [2cp, ...] in global order: ``carried[j+1] = step(carried[j], j)`` from
    zero; returns the states carried into this rank's two slices, stacked [2, ...]."""
    state = torch.zeros_like(final[0])
    carried = []
    for j in range(2 * cp_size):
        carried.append(state)
        state = step(state, j)
    head, tail = _local_slices(cp_size, cp_rank)
    return torch.stack((carried[head], carried[tail]))


def ring_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weights: ConvWeights,
    attn: AttentionInputs,
    *,
    group: dist.ProcessGroup | str,
    cp_rank: int,
    cp_size: int,
    chunk_size: int = 64,
) -> torch.Tensor:
    """``GatedDeltaNet.linear_attn_op`` for ``cp_type: ring`` on this rank's head-tail shard [B, 2c, ...]
    (signature in nemo_ac.models.layers.gated_deltanet); equals the single-sequence op on the full rows."""
    meta = _ring_meta(attn, "linear attention")
    wq, wk, wv = conv_weights
    halo = wq.shape[-1] - 1
    b, _, hk, dk = q.shape
    hv, dv = v.shape[2:]
    layout = SliceLayout(meta.document_ids.to(q.device), cp_size=cp_size, cp_rank=cp_rank, halo=halo)
    packed = torch.cat((q.flatten(2), k.flatten(2), v.flatten(2)), dim=-1)
    ext = _with_halo(packed, halo=halo, group=group, cp_size=cp_size, cp_rank=cp_rank)
    q_ext, k_ext, v_ext = ext.split([hk * dk, hk * dk, hv * dv], dim=-1)
    rows, width = ext.shape[:2]

    def conv(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return packed_causal_conv1d(t.reshape(rows, width, w.shape[0], w.shape[1]), w, layout.runs)[:, halo:]

    qs, ks, vs = conv(q_ext, wq), conv(k_ext, wk), conv(v_ext, wv)
    if hv > hk:
        qs = qs.repeat_interleave(hv // hk, dim=2)
        ks = ks.repeat_interleave(hv // hk, dim=2)
    acc = accumulation_dtype(q.dtype)
    qs, ks = l2norm(qs.to(acc)), l2norm(ks.to(acc))
    # Value columns [v | 0] from the initial state [0 | I]: the extra dk columns carry the slice's transition.
    vs = torch.cat((vs.to(acc), vs.new_zeros(*vs.shape[:3], dk, dtype=acc)), dim=-1)
    eye = torch.eye(dk, dtype=acc, device=q.device)
    initial = torch.cat((eye.new_zeros(dk, dv), eye), dim=-1).expand(rows, hv, dk, dv + dk)
    out, final = chunk_gated_delta_rule(
        qs,
        ks,
        vs,
        _to_slices(g),
        _to_slices(beta),
        doc_starts=layout.starts,
        chunk_size=chunk_size,
        initial_state=initial,
        output_final_state=True,
    )
    out_zero, out_transition = out.split([dv, dk], dim=-1)  # [2B, c, Hv, dv], [2B, c, Hv, dk]
    finals = gather_slices(final.reshape(2, b, hv, dk, dv + dk), group=group, cp_size=cp_size)
    written, transition = finals.split([dv, dk], dim=-1)  # F [2cp, B, Hv, dk, dv], T [2cp, B, Hv, dk, dk]
    carried = _carried_states(
        written, lambda s, j: transition[j] @ s + written[j], cp_size=cp_size, cp_rank=cp_rank
    ).reshape(rows, hv, dk, dv)
    out = out_zero + torch.einsum("bthk,bhkv->bthv", out_transition, carried)
    return _from_slices(out).to(v.dtype)


def ring_ssm(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    params: Mamba2CoreParams,
    attn: AttentionInputs,
    *,
    group: dist.ProcessGroup | str,
    cp_rank: int,
    cp_size: int,
) -> torch.Tensor:
    """``Mamba2Mixer.ssm_op`` for ``cp_type: ring`` on this rank's head-tail shard [B, 2c, ...] (signature in
    nemo_ac.models.layers.mamba2); equals ``mamba2_ssm`` on the full rows."""
    meta = _ring_meta(attn, "Mamba-2 scan")
    halo = params.conv_x_weight.shape[-1] - 1
    b, _, nh, hd = x.shape
    groups, n = B.shape[2:]
    if nh % groups:
        raise ValueError(f"{nh} heads cannot share {groups} B/C groups evenly")
    layout = SliceLayout(meta.document_ids.to(x.device), cp_size=cp_size, cp_rank=cp_rank, halo=halo)
    packed = torch.cat((x.flatten(2), B.flatten(2), C.flatten(2)), dim=-1)
    ext = _with_halo(packed, halo=halo, group=group, cp_size=cp_size, cp_rank=cp_rank)
    x_ext, b_ext, c_ext = ext.split([nh * hd, groups * n, groups * n], dim=-1)

    def conv(t: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat_bias = None if bias is None else bias.reshape(-1)
        out = causal_depthwise_conv1d(t, w.reshape(-1, w.shape[-1]), flat_bias, layout.runs)
        return F.silu(out[:, halo:])

    rows = ext.shape[0]
    xs = conv(x_ext, params.conv_x_weight, params.conv_x_bias).reshape(rows, -1, nh, hd)
    bs = conv(b_ext, params.conv_b_weight, params.conv_b_bias).reshape(rows, -1, groups, n)
    cs = conv(c_ext, params.conv_c_weight, params.conv_c_bias).reshape(rows, -1, groups, n)
    dts = _to_slices(dt)
    y, final = ssd_chunk_scan(xs, dts, bs, cs, params, layout.runs[:, halo:], output_final_state=True)
    # The carried state decays by exp(cumsum a) from the slice start and is read until the first document start.
    acc = y.dtype
    a = params.A.to(acc) * F.softplus(dts.to(acc) + params.dt_bias.to(acc)).clamp(params.dt_min, params.dt_max)
    cum = a.cumsum(dim=1)  # [2B, c, nh]
    reads = (layout.starts.to(torch.int32).cumsum(dim=1) == 0).to(cum.dtype)  # [2B, c]
    decay = cum[:, -1].exp() * reads[:, -1:]  # [2B, nh]: 0 when a document starts in the slice
    packed_final = torch.cat((final.flatten(2), decay[..., None]), dim=-1).reshape(2, b, nh, hd * n + 1)
    finals = gather_slices(packed_final, group=group, cp_size=cp_size)
    written = finals[..., :-1].reshape(2 * cp_size, b, nh, hd, n)
    decays = finals[..., -1][..., None, None]
    carried = _carried_states(
        written, lambda s, j: decays[j] * s + written[j], cp_size=cp_size, cp_rank=cp_rank
    ).reshape(rows, nh, hd, n)
    c_heads = cs.to(acc).repeat_interleave(nh // groups, dim=2)
    correction = torch.einsum("bthn,bhpn->bthp", c_heads, carried) * (cum.exp() * reads[..., None])[..., None]
    return _from_slices(y + correction)
