"""Rotary position embedding in Hugging Face's ``rotate_half`` convention.

Frequencies follow transformers' default rope: ``inv_freq = 1 / theta ** (arange(0, d, 2) / d)`` with
``d = int(head_dim * partial_rotary_factor)``; cos/sin are computed in fp32 and cast to the activation dtype, and
only the first ``d`` dims of each head are rotated (GLM uses half). Positions come from ``position_ids`` so packed
documents restart at 0 without any attention-side bookkeeping.
"""

from __future__ import annotations

import torch
from torch import nn


def compute_inv_freq(head_dim: int, theta: float, partial_rotary_factor: float = 1.0) -> torch.Tensor:
    """The fp32 inverse frequencies, always on CPU (also under a ``torch.device("meta")`` context)."""
    dim = int(head_dim * partial_rotary_factor)
    if dim <= 0 or dim % 2:
        raise ValueError(
            f"rotary dim must be a positive even number, got head_dim={head_dim} * {partial_rotary_factor}"
        )
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    return 1.0 / (theta**exponent)


class RotaryEmbedding(nn.Module):
    """Produces ``(cos, sin)`` of shape [B, S, rotary_dim] from ``position_ids`` [B, S].

    ``inv_freq`` is a plain CPU fp32 tensor attribute, deliberately neither a parameter nor a buffer: it stays out
    of the state dict (as in transformers), survives meta-device construction and ``to_empty`` with real values,
    and ``model.to(torch.bfloat16)`` cannot round it. It is copied to the positions' device each forward (d/2
    floats, once per model forward).
    """

    def __init__(self, head_dim: int, theta: float, partial_rotary_factor: float = 1.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.partial_rotary_factor = partial_rotary_factor
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.inv_freq = compute_inv_freq(head_dim, theta, partial_rotary_factor)

    @torch.no_grad()
    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(device=position_ids.device, non_blocking=True)
        # [B, S, 1] * [d/2] in fp32, autocast off so bf16 autocast cannot degrade the angles.
        with torch.autocast(device_type=position_ids.device.type, enabled=False):
            freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims: [x1, x2] -> [-x2, x1]."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [B, S, nh, hd] and k [B, S, nkv, hd] with cos/sin [B, S, rotary_dim].

    Dims past ``rotary_dim`` pass through unchanged (partial rotary, identical to transformers' GLM code).
    """
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    k_rot = k_rot * cos + rotate_half(k_rot) * sin
    return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)
