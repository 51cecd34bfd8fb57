"""Gated DeltaNet linear attention (the ``linear_attention`` layers of Qwen3.5 / Qwen3.6) over packed documents.

Parameter names equal transformers' ``Qwen3_5MoeGatedDeltaNet`` (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
conv1d, dt_bias, A_log, norm, out_proj), so HF checkpoints load by name.

Everything that mixes along the sequence -- the causal depthwise conv1d over the q/k/v channels and the gated delta
rule recurrence -- lives in one swappable op, ``GatedDeltaNet.linear_attn_op`` (a plain attribute, like
``Attention.attn_op``)::

    linear_attn_op(q, k, v, g, beta, conv_weights, attn) -> out [B, S, Hv, dv]  (dtype of v)
      q, k:  [B, S, Hk, dk]  in_proj_qkv output, before the conv (the op convolves, applies SiLU, L2-normalizes)
      v:     [B, S, Hv, dv]  idem
      g:     [B, S, Hv] fp32 log-decay (<= 0): the state is multiplied by exp(g_t) at token t
      beta:  [B, S, Hv] write strength in (0, 1)
      conv_weights: (wq [Hk, dk, K], wk [Hk, dk, K], wv [Hv, dv, K]) the depthwise conv kernel split per head
      attn:  AttentionInputs whose document_ids cover the sequence the op sees

All other work of the layer is per token, so Ulysses context parallelism can all-to-all every input from
[B, S/cp, H, .] to [B, S, H/cp, .], slice the conv weights along dim 0 to the local heads (a rank keeps Hk/cp key
heads and the Hv/cp value heads that read them, since value head i reads key head i // (Hv/Hk)), call the inner op
with the full-sequence document_ids and all-to-all the output back. Ring CP replaces the op by
``context_parallel.state_passing.ring_linear_attention``: each rank runs its slices from a zero state
(``chunk_gated_delta_rule(initial_state=..., output_final_state=True)``) and adds the carried state's contribution
after an exchange of the per-slice final states and transitions.

The torch core of the op (the packed causal conv1d and the chunked gated delta rule) is
``nemo_ac.models.kernels.gated_delta_rule``; ``backend.linear_attention: fla`` swaps in
``nemo_ac.models.kernels.fla_gdn``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from nemo_ac.config.schema import LinearAttentionConfig
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.kernels.gated_delta_rule import ConvWeights, LinearAttentionOp, packed_gated_delta_rule
from nemo_ac.workarounds.softplus_backward_layout import softplus

__all__ = ["GatedDeltaNet", "GatedRMSNorm"]


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm then ``* silu(gate)`` (transformers' ``Qwen3_5MoeRMSNormGated``; weight initialized to 1)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def initial_parameter(self, name: str, generator: torch.Generator) -> torch.Tensor | None:
        """Init hook of ``nemo_ac.models.init``: the scale starts at one."""
        return torch.ones(self.weight.shape) if name == "weight" else None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(input_dtype)
        return (out * F.silu(gate.to(torch.float32))).to(input_dtype)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer. ``forward(x [B, S, H], *, attn) -> [B, S, H]``."""

    # interfaces.SequenceMixer: context parallel swaps ``linear_attn_op`` (ulysses: wraps it; ring: state passing).
    mixer_kind = "linear_attention"
    mixer_op_name = "linear_attn_op"

    def __init__(self, hidden_size: int, cfg: LinearAttentionConfig, *, rms_norm_eps: float = 1e-6) -> None:
        super().__init__()
        if cfg.num_value_heads % cfg.num_key_heads:
            raise ValueError(
                f"linear_attention.num_value_heads ({cfg.num_value_heads}) must be a multiple of num_key_heads "
                f"({cfg.num_key_heads})"
            )
        self.num_k_heads = cfg.num_key_heads
        self.num_v_heads = cfg.num_value_heads
        self.head_k_dim = cfg.key_head_dim
        self.head_v_dim = cfg.value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_kernel_size = cfg.conv_kernel
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        # Only its weight [conv_dim, 1, K] is used (by the op); the module keeps the HF name and shape.
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, kernel_size=cfg.conv_kernel, groups=conv_dim, bias=False, padding=cfg.conv_kernel - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        # Swappable sequence-mixing core (context parallel); a plain attribute, not a submodule.
        self.chunk_size = cfg.chunk_size  # also read by ring CP's state-passing op
        self.linear_attn_op: LinearAttentionOp = functools.partial(packed_gated_delta_rule, chunk_size=cfg.chunk_size)

    def initial_parameter(self, name: str, generator: torch.Generator) -> torch.Tensor | None:
        """Init hook of ``nemo_ac.models.init`` (transformers' scheme): ``A = exp(A_log) ~ U(0.01, 16)`` per value
        head, ``dt_bias = 1``; projections and the conv kernel take the default normal init."""
        if name == "A_log":
            return torch.empty(self.num_v_heads).uniform_(0.01, 16.0, generator=generator).log_()
        if name == "dt_bias":
            return torch.ones(self.num_v_heads)
        return None

    def conv_weights(self) -> ConvWeights:
        """The depthwise kernel split per head: (q [Hk, dk, K], k [Hk, dk, K], v [Hv, dv, K])."""
        w = self.conv1d.weight.squeeze(1)
        wq, wk, wv = w.split([self.key_dim, self.key_dim, self.value_dim], dim=0)
        kernel = self.conv_kernel_size
        return (
            wq.reshape(self.num_k_heads, self.head_k_dim, kernel),
            wk.reshape(self.num_k_heads, self.head_k_dim, kernel),
            wv.reshape(self.num_v_heads, self.head_v_dim, kernel),
        )

    def forward(self, x: torch.Tensor, *, attn: AttentionInputs) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.in_proj_qkv(x).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, s, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, s, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, s, self.num_v_heads, self.head_v_dim)
        z = self.in_proj_z(x).reshape(b, s, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()
        # fp32 so that exp(A_log) cannot overflow in low precision (as transformers does).
        g = -self.A_log.to(torch.float32).exp() * softplus(self.in_proj_a(x).to(torch.float32) + self.dt_bias)
        out = self.linear_attn_op(q, k, v, g, beta, self.conv_weights(), attn)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(b, s, self.value_dim))
