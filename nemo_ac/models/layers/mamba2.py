"""Mamba-2 mixer (Nemotron-H) in pure torch: packed-document aware, with a swappable sequence-mixing core.

Parameter names equal transformers' ``NemotronHMamba2Mixer`` (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``,
``D``, ``norm``, ``out_proj``), so checkpoints load by name. The forward is::

    in_proj(h) -> [z (I) | x (I) | B (G*N) | C (G*N) | dt (nh)]          I = nh * hd
    y = ssm_op(x [B,S,nh,hd], B [B,S,G,N], C [B,S,G,N], dt [B,S,nh], params, attn)     (fp32)
    out_proj(norm(y, z))                                                  gated, group-wise RMSNorm

Everything outside ``ssm_op`` is pointwise along the sequence, so it runs unchanged on a sequence shard.

``ssm_op`` (attribute, default ``mamba2_ssm``) is the whole sequence-mixing core: the causal depthwise conv1d
(kernel K) + SiLU on x / B / C and the chunked SSD scan with the D skip. Signature::

    ssm_op(x, B, C, dt, params: Mamba2CoreParams, attn: AttentionInputs) -> y [B, S, nh, hd] float32

- dim 1 of every tensor is the sequence; dim 2 is heads (x, dt) or B/C groups (head h reads group
  h // (nh / G)). Inputs are the raw ``in_proj`` outputs (before the conv).
- ``params`` holds the conv taps, ``A = -exp(A_log)``, ``D`` and ``dt_bias`` with heads (or groups) on dim 0,
  plus ``chunk_size`` and the dt clamp; ``params.select(heads, groups)`` cuts a head range.
- ``attn.document_ids`` [B, S] must describe the same positions as dim 1. Documents are maximal runs of equal ids:
  neither the conv window nor the SSM state crosses a run boundary, so packed rows equal their documents run alone.

Ulysses context parallel wraps this op: all-to-all x / dt (heads) and B / C (groups; needs G % cp == 0, otherwise
B / C must be gathered instead) from sequence-sharded to head-sharded, call the inner op with
``params.select(...)`` for this rank's heads and groups and full-sequence document ids, all-to-all y back. Ring CP
replaces it by ``context_parallel.state_passing.ring_ssm``: each rank scans its slices from a zero state
(``ssd_chunk_scan(output_final_state=True)``), the final states and decays are exchanged, and each slice adds the
carried state's contribution.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from nemo_ac.config.schema import MambaConfig
from nemo_ac.models.interfaces import AttentionInputs


@dataclass
class Mamba2CoreParams:
    """Weights of the sequence-mixing core, heads (or B/C groups) on dim 0 so a head range is one slice."""

    conv_x_weight: torch.Tensor  # [nh, hd, K]
    conv_x_bias: torch.Tensor | None  # [nh, hd]
    conv_b_weight: torch.Tensor  # [G, N, K]
    conv_b_bias: torch.Tensor | None  # [G, N]
    conv_c_weight: torch.Tensor  # [G, N, K]
    conv_c_bias: torch.Tensor | None  # [G, N]
    A: torch.Tensor  # [nh] fp32, negative
    D: torch.Tensor  # [nh]
    dt_bias: torch.Tensor  # [nh]
    chunk_size: int
    dt_min: float = 0.0
    dt_max: float = float("inf")

    def select(self, heads: slice, groups: slice) -> Mamba2CoreParams:
        """The params of a head range and its B/C group range (for head-sharded context parallel)."""

        def cut(t: torch.Tensor | None, s: slice) -> torch.Tensor | None:
            return None if t is None else t[s]

        return replace(
            self,
            conv_x_weight=self.conv_x_weight[heads],
            conv_x_bias=cut(self.conv_x_bias, heads),
            conv_b_weight=self.conv_b_weight[groups],
            conv_b_bias=cut(self.conv_b_bias, groups),
            conv_c_weight=self.conv_c_weight[groups],
            conv_c_bias=cut(self.conv_c_bias, groups),
            A=self.A[heads],
            D=self.D[heads],
            dt_bias=self.dt_bias[heads],
        )


Mamba2Op = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Mamba2CoreParams, AttentionInputs], torch.Tensor
]


def segment_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] index of the run of equal document ids each token is in (0, 1, ... per row).

    Runs, not raw ids, define isolation, so two separate stretches of padding (-1) do not see each other and
    every comparison below can assume segments are contiguous.
    """
    change = torch.zeros_like(document_ids, dtype=torch.int32)
    if document_ids.shape[1] > 1:
        change[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).to(torch.int32)
    return torch.cumsum(change, dim=1)


def causal_depthwise_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, segments: torch.Tensor
) -> torch.Tensor:
    """``out[t] = bias + sum_j weight[:, j] * x[t - (K-1) + j]`` over taps in the same segment as ``t``.

    x [B, S, C], weight [C, K], segments [B, S]. Written as K shifted multiply-adds (K = 4 in Nemotron-H) rather
    than ``F.conv1d`` so taps from a previous document are masked per token; each tap's product is taken against
    a slice (a view) of one padded copy of x, so autograd keeps one extra copy of x, not K.
    """
    s, k = x.shape[1], weight.shape[-1]
    padded = F.pad(x, (0, 0, k - 1, 0))
    out = None
    taps = weight.unbind(-1)  # one split: per-tap indexing would write a full-size gradient per tap
    for j in range(k):
        shift = k - 1 - j
        term = padded[:, j : j + s] * taps[j]
        if shift:
            earlier = F.pad(segments, (shift, 0), value=-1)[:, :s]
            term = term * (earlier == segments).unsqueeze(-1).to(term.dtype)
        out = term if out is None else out + term
    assert out is not None
    return out + bias if bias is not None else out


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T] with ``out[i, j] = sum(x[j+1 : i+1])`` for i >= j and -inf above the diagonal
    (cumsum of a masked copy, not a difference of cumsums: no cancellation; same as transformers)."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    strict = torch.tril(torch.ones(t, t, device=x.device, dtype=torch.bool), diagonal=-1)
    out = torch.cumsum(x.masked_fill(~strict, 0), dim=-2)
    lower = torch.tril(torch.ones(t, t, device=x.device, dtype=torch.bool), diagonal=0)
    return out.masked_fill(~lower, -torch.inf)


def _pad_always() -> bool:
    """Under torch.compile the chunk padding is unconditional (a pad of 0 where S is a multiple of the chunk): a
    branch on ``S % chunk`` would be a guard on the row length, and rows whose length varies per micro batch would
    compile a second graph for the other kind (``((16 + (-1)*(args[0].size()[1] % 16)) % 16) == 0  # if pad:``)."""
    return torch.compiler.is_compiling()


def _clamped_positions(s: int, pad: int, device: torch.device) -> torch.Tensor:
    """0 .. s-1, then s-1 repeated ``pad`` times: a row padded by repeating its last position."""
    return torch.arange(s + pad, device=device).clamp(max=s - 1)


def _chunks(t: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """[B, S, ...] -> [B, S/chunk, chunk, ...] after zero-padding S (compiled: always, ``_pad_always``, as a gather
    and a mask: no tensor of the pad's own length, whose size 0 would be guarded on)."""
    if _pad_always():
        s = t.shape[1]
        keep = torch.arange(s + pad, device=t.device) < s
        t = t.index_select(1, _clamped_positions(s, pad, t.device)) * keep.view(1, -1, *([1] * (t.dim() - 2)))
    elif pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: Mamba2CoreParams,
    segments: torch.Tensor,
    *,
    output_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD (state-space dual) scan, fp32 (fp64 for fp64 inputs): transformers' ``mamba2_chunk_scan`` plus segment masks.

    x [B, S, nh, hd], dt [B, S, nh] (raw), B / C [B, S, G, N], segments [B, S]. Returns [B, S, nh, hd] fp32.
    Isolation masks (exact, by multiplication with 0/1): intra-chunk pairs must share a segment; a chunk's
    end state only collects its last segment's tokens; chunk states propagate only between chunk ends in the same
    segment; a token reads the carried state only if it is in the segment of the previous chunk's end.

    With ``output_final_state`` returns ``(y, final)``, ``final`` [B, nh, hd, N] fp32 the state after the last
    token (only its segment's tokens); context parallel carries it into the next sequence slice
    (``context_parallel.state_passing``), whose tokens add ``C_t . exp(cumsum a) * final`` themselves.
    """
    b, s, nh, hd = x.shape
    rep = nh // B.shape[2]
    chunk = params.chunk_size
    acc = torch.promote_types(x.dtype, torch.float32)  # fp64 inputs (parity tests) keep fp64
    dt = F.softplus(dt.to(acc) + params.dt_bias.to(acc)).clamp(params.dt_min, params.dt_max)
    x = x.to(acc)
    B = B.to(acc).repeat_interleave(rep, dim=2)
    C = C.to(acc).repeat_interleave(rep, dim=2)
    pad = (chunk - s % chunk) % chunk
    d_residual = params.D[:, None] * x
    x = x * dt[..., None]
    a = params.A.to(acc) * dt
    x, a, B, C = (_chunks(t, pad, chunk) for t in (x, a, B, C))
    if _pad_always():  # padded tail positions continue the last segment (their x, B, C are zero)
        segments = segments.index_select(1, _clamped_positions(s, pad, segments.device))
    elif pad:
        segments = torch.cat([segments, segments[:, -1:].expand(b, pad)], dim=1)
    seg = segments.reshape(b, -1, chunk)  # [b, c, l]

    a = a.permute(0, 3, 1, 2)  # [b, h, c, l]
    a_cumsum = torch.cumsum(a, dim=-1)

    # 1. Within each chunk: attention-like, decay-masked and segment-masked.
    same = (seg[:, :, :, None] == seg[:, :, None, :]).to(a.dtype)  # [b, c, l, s]
    decay = torch.exp(_segment_sum(a)) * same[:, None]
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)

    # 2. Each chunk's end state from its own tokens (only the segment alive at the chunk end).
    end_seg = seg[:, :, -1]  # [b, c]
    alive = (seg == end_seg[..., None]).to(a.dtype)  # [b, c, l]
    decay_states = torch.exp(a_cumsum[..., -1:] - a_cumsum) * alive[:, None]
    states = torch.einsum("bclhn,bclhp->bchpn", B * decay_states.permute(0, 2, 3, 1)[..., None], x)

    # 3. Carry states across chunks (index 0 is the zero initial state) within a segment.
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    boundary = torch.cat([end_seg[:, :1], end_seg], dim=1)  # segment at the end of chunk i-1 (index i)
    carry = (boundary[:, :, None] == boundary[:, None, :]).to(a.dtype)  # [b, target, source]
    decay_chunk = torch.exp(_segment_sum(F.pad(a_cumsum[..., -1], (1, 0)))) * carry[:, None]
    states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk.transpose(1, 3), states)
    final = states[:, -1]  # after the last chunk (padded tail tokens decay by exp(0) and write nothing)
    states = states[:, :-1]

    # 4. Carried state -> output, for tokens still in the segment that the previous chunk ended in.
    reads = (seg == boundary[:, :-1, None]).to(a.dtype)  # [b, c, l]
    state_decay_out = torch.exp(a_cumsum) * reads[:, None]
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * state_decay_out.permute(0, 2, 3, 1)[..., None]

    y = (y_diag + y_off).reshape(b, -1, nh, hd)
    # Compiled, a gather of the first s rows rather than a slice: the slice's contiguity (padded length == s) would
    # be guarded on, as ``if pad`` would be.
    y = y.index_select(1, torch.arange(s, device=y.device)) if _pad_always() else y[:, :s]
    y = y + d_residual
    return (y, final) if output_final_state else y


def mamba2_ssm(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    params: Mamba2CoreParams,
    attn: AttentionInputs,
) -> torch.Tensor:
    """Default ``ssm_op``: segment-masked causal conv + SiLU on x / B / C, then the chunked SSD scan.

    Refuses inputs marked as a context-parallel shard: run on one rank's sequence shard it would silently restart
    the recurrence at the shard edge. A CP wrapper calls it with full-sequence inputs and plain ``AttentionInputs``.
    """
    if attn.context_parallel is not None:
        raise RuntimeError(
            "Mamba-2 got a context-parallel sequence shard but its ssm_op is the single-sequence default; the "
            "parallelizer must install the ulysses ssm_op (or ring CP's state-passing one) on Mamba layers"
        )
    b, s, nh, _ = x.shape
    if nh % B.shape[2]:
        raise ValueError(f"{nh} heads cannot share {B.shape[2]} B/C groups evenly")
    segments = segment_ids(attn.document_ids.to(x.device))

    def conv(t: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat_bias = None if bias is None else bias.reshape(-1)
        out = causal_depthwise_conv1d(t.reshape(b, s, -1), w.reshape(-1, w.shape[-1]), flat_bias, segments)
        return F.silu(out).view_as(t)

    x = conv(x, params.conv_x_weight, params.conv_x_bias)
    B = conv(B, params.conv_b_weight, params.conv_b_bias)
    C = conv(C, params.conv_c_weight, params.conv_c_bias)
    return ssd_chunk_scan(x, dt, B, C, params, segments)


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm_groupwise(y * silu(z))`` in fp32, cast to y's dtype before the weight (transformers'
    Zamba2RMSNormGated, which NemotronH uses with ``group_size = I / n_groups``)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def initial_parameter(self, name: str, generator: torch.Generator) -> torch.Tensor:
        return torch.ones(self.weight.shape)

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = y.dtype
        h = y.to(torch.float32) * F.silu(gate.to(torch.float32))
        *prefix, width = h.shape
        h = h.view(*prefix, width // self.group_size, self.group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.view(*prefix, width).to(input_dtype)


class Mamba2Mixer(nn.Module):
    """Nemotron-H Mamba-2 mixer. ``forward(h [B, S, H], *, attn) -> [B, S, H]``; see the module docstring."""

    # interfaces.SequenceMixer: context parallel swaps ``ssm_op`` (ulysses: wraps it; ring: state passing).
    mixer_kind = "ssm"
    mixer_op_name = "ssm_op"

    def __init__(self, hidden_size: int, cfg: MambaConfig, *, rms_norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.n_groups = cfg.n_groups
        self.state_size = cfg.state_size
        self.chunk_size = cfg.chunk_size
        self.time_step_min = cfg.time_step_min
        self.time_step_max = cfg.time_step_max
        self.time_step_floor = cfg.time_step_floor
        if cfg.num_heads % cfg.n_groups:
            raise ValueError(f"mamba num_heads={cfg.num_heads} must be a multiple of n_groups={cfg.n_groups}")
        self.intermediate_size = cfg.num_heads * cfg.head_dim
        self.conv_dim = self.intermediate_size + 2 * cfg.n_groups * cfg.state_size
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=cfg.conv_kernel,
            groups=self.conv_dim,
            padding=cfg.conv_kernel - 1,
            bias=cfg.conv_bias,
        )
        self.in_proj = nn.Linear(
            hidden_size, self.intermediate_size + self.conv_dim + cfg.num_heads, bias=cfg.proj_bias
        )
        self.dt_bias = nn.Parameter(torch.empty(cfg.num_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.num_heads))
        self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // cfg.n_groups, rms_norm_eps)
        self.D = nn.Parameter(torch.empty(cfg.num_heads))
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=cfg.proj_bias)
        # Swappable sequence-mixing core (context parallel); a plain function attribute, not a submodule.
        self.ssm_op: Mamba2Op = mamba2_ssm

    def initial_parameter(self, name: str, generator: torch.Generator) -> torch.Tensor | None:
        """Mamba's own init (transformers' NemotronH): A = 1..nh, D = 1, dt_bias = softplus^-1(dt) with dt
        log-uniform in [time_step_min, time_step_max]; other parameters use the default rule (None)."""
        if name == "A_log":
            return torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32))
        if name == "D":
            return torch.ones(self.num_heads)
        if name == "dt_bias":
            lo, hi = math.log(self.time_step_min), math.log(self.time_step_max)
            dt = torch.exp(torch.rand(self.num_heads, generator=generator) * (hi - lo) + lo)
            dt = dt.clamp(min=self.time_step_floor)
            return dt + torch.log(-torch.expm1(-dt))
        return None

    def core_params(self) -> Mamba2CoreParams:
        """Views of this mixer's weights in the per-head layout ``ssm_op`` takes."""
        nh, hd, g, n = self.num_heads, self.head_dim, self.n_groups, self.state_size
        w = self.conv1d.weight.squeeze(1)
        wx, wb, wc = w.split([nh * hd, g * n, g * n], dim=0)
        k = w.shape[-1]
        bx = bb = bc = None
        if self.conv1d.bias is not None:
            bx, bb, bc = self.conv1d.bias.split([nh * hd, g * n, g * n], dim=0)
            bx, bb, bc = bx.view(nh, hd), bb.view(g, n), bc.view(g, n)
        return Mamba2CoreParams(
            conv_x_weight=wx.reshape(nh, hd, k),
            conv_x_bias=bx,
            conv_b_weight=wb.reshape(g, n, k),
            conv_b_bias=bb,
            conv_c_weight=wc.reshape(g, n, k),
            conv_c_bias=bc,
            A=-torch.exp(self.A_log.float()),
            D=self.D,
            dt_bias=self.dt_bias,
            chunk_size=self.chunk_size,
            dt_min=self.time_step_min,
        )

    def forward(self, hidden: torch.Tensor, *, attn: AttentionInputs) -> torch.Tensor:
        b, s, _ = hidden.shape
        nh, hd, g, n = self.num_heads, self.head_dim, self.n_groups, self.state_size
        gate, x, B, C, dt = self.in_proj(hidden).split([nh * hd, nh * hd, g * n, g * n, nh], dim=-1)
        y = self.ssm_op(
            x.reshape(b, s, nh, hd), B.reshape(b, s, g, n), C.reshape(b, s, g, n), dt, self.core_params(), attn
        )
        y = self.norm(y.reshape(b, s, nh * hd), gate)
        return self.out_proj(y.to(hidden.dtype))
