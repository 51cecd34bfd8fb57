"""Self-attention over packed documents.

``Attention`` keeps transformers' parameter names (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm) and works in the
[B, S, heads, head_dim] layout end to end. The core op is a plain attribute, ``attn_op``, called as
``attn_op(q, k, v, attn_inputs) -> [B, S, nh, hd]``: the parallelizer swaps in Ulysses / ring context-parallel ops
by assignment, so this module never imports distributed code.

Local kernels (``backend.attention``, chosen in the parallel plan, ``ATTENTION_OPS``):

- ``sdpa``, ``packed_causal_attention``: SDPA with a dense [B, 1, S, S] document mask built with tensor ops only (no
  ``.item()``, no Python branches on tensor values). The reference: memory and FLOPs grow with S squared.
- ``tiled``, ``tiled_packed_attention``: the tiled custom op of ``packed_attention`` (memory linear in S, work
  proportional to the visible pairs), bounded by ``max_seqlen``; runs everywhere.
- ``flex``, ``flex_packed_attention_op``: FlexAttention with a document block mask (CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.kernels.flex_attention import flex_packed_attention
from nemo_ac.models.kernels.packed_attention import packed_attention
from nemo_ac.models.layers.rmsnorm import RMSNorm
from nemo_ac.models.layers.rope import apply_rotary

AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionInputs], torch.Tensor]


def build_attention_inputs(document_ids: torch.Tensor) -> AttentionInputs:
    """Varlen metadata from document ids [B, S] (call it in the data path, outside compiled regions).

    Every maximal run of equal ids within a row is one segment of ``cu_seqlens`` (over the flattened batch); a
    row boundary always starts a new segment. ``max_seqlen`` is a Python int (it syncs with the device once).
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [B, S], got shape {tuple(document_ids.shape)}")
    b, s = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    if s > 1:
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_idx = starts.reshape(-1).nonzero().squeeze(-1)
    total = torch.tensor([b * s], dtype=start_idx.dtype, device=start_idx.device)
    cu_seqlens = torch.cat((start_idx, total)).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if b * s > 0 else 0
    return AttentionInputs(document_ids=document_ids.to(torch.int32), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, 1, S, S], True = attend: same document and causal.

    Padding (document id -1) attends only to itself, so no query row is fully masked (SDPA would return NaN).
    """
    s = document_ids.shape[-1]
    q_doc = document_ids.unsqueeze(-1)
    k_doc = document_ids.unsqueeze(-2)
    idx = torch.arange(s, device=document_ids.device)
    causal = idx.unsqueeze(-1) >= idx.unsqueeze(0)
    diagonal = idx.unsqueeze(-1) == idx.unsqueeze(0)
    mask = ((q_doc == k_doc) & (k_doc >= 0) & causal) | diagonal
    return mask.unsqueeze(1)


def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionInputs, *, scale: float | None = None
) -> torch.Tensor:
    """SDPA over packed documents. q [B, S, nh, hd], k/v [B, S, nkv, hd] -> [B, S, nh, hd].

    GQA repeats k/v heads with ``repeat_interleave`` (head i uses kv head i // (nh / nkv), as transformers does)
    rather than ``enable_gqa``, so every SDPA backend that accepts a mask can run it.
    """
    nh, nkv = q.shape[2], k.shape[2]
    if nh != nkv:
        k = k.repeat_interleave(nh // nkv, dim=2)
        v = v.repeat_interleave(nh // nkv, dim=2)
    mask = document_causal_mask(attn.document_ids.to(q.device))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


def _local_kernel_inputs(q: torch.Tensor, attn: AttentionInputs) -> dict:
    docs = attn.document_ids.to(q.device)
    positions = torch.arange(q.shape[1], device=q.device)
    # No document is longer than max_seqlen, so no visible key lies that far back: a real bound on the work.
    return {
        "q_doc": docs,
        "k_doc": docs,
        "q_pos": positions,
        "k_pos": positions,
        "max_back": torch.sym_max(attn.max_seqlen, 1),
    }


def tiled_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionInputs, *, scale: float | None = None
) -> torch.Tensor:
    """``backend.attention: tiled``: q [B, S, nh, hd], k/v [B, S, nkv, hd] -> [B, S, nh, hd], no [S, S] tensor."""
    out, _ = packed_attention(q, k, v, scale=scale, **_local_kernel_inputs(q, attn))
    return out


def flex_packed_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionInputs, *, scale: float | None = None
) -> torch.Tensor:
    """``backend.attention: flex``: FlexAttention with a document block mask (CUDA), built once per micro batch in
    eager mode (keyed by its document ids: every layer and every full-AC recompute reuses it)."""
    inputs = _local_kernel_inputs(q, attn)
    out, _ = flex_packed_attention(q, k, v, scale=scale, mask_key=attn.document_ids, **inputs)
    return out


def set_attention_kernel(layers: nn.Module, *, kernel: str) -> int:
    """Give every softmax attention in ``layers`` the local op of ``kernel`` (sdpa / tiled / flex; te swaps a
    module in instead, see te_backend); returns how many were set. Runs before context parallel wraps the op."""
    if kernel not in ATTENTION_OPS:
        return 0
    count = 0
    for module in layers.modules():
        if isinstance(module, Attention):
            module.attn_op = ATTENTION_OPS[kernel]
            count += 1
    return count


# backend.attention -> the local op (te is swapped in as a module by te_backend; ring CP uses the matching block
# kernel of nemo_ac.distributed.context_parallel.ring).
ATTENTION_OPS: dict[str, AttentionOp] = {
    "sdpa": packed_causal_attention,
    "tiled": tiled_packed_attention,
    "flex": flex_packed_attention_op,
}


class Attention(nn.Module):
    """Multi-head attention with GQA, optional per-head q/k RMSNorm (Qwen3) and optional projection biases.

    ``attention_bias`` puts biases on q/k/v and, unless ``o_proj_bias`` says otherwise, on o_proj (Qwen3); GLM-4.5
    biases q/k/v only (``o_proj_bias=False``). ``rope=None`` in forward skips rotary embedding (Nemotron-H
    attention layers use no positional encoding). ``output_gate`` (Qwen3.5/3.6 gated attention) makes q_proj also
    emit a per-head gate and scales the attention output by ``sigmoid(gate)`` before o_proj; ``norm_cls`` builds the
    q/k norms (Qwen3.5 uses a zero-centered RMSNorm).
    """

    # interfaces.SequenceMixer: context parallel swaps ``attn_op`` (ulysses or ring).
    mixer_kind = "softmax_attention"
    mixer_op_name = "attn_op"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool = True,
        attention_bias: bool = False,
        rms_norm_eps: float = 1e-6,
        o_proj_bias: bool | None = None,
        output_gate: bool = False,
        norm_cls: Callable[[int, float], nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.output_gate = output_gate
        # With an output gate q_proj also yields the gate: per head [q_h | gate_h] (Qwen3.5/3.6 layout).
        q_out = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(hidden_size, q_out, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(
            num_heads * head_dim, hidden_size, bias=attention_bias if o_proj_bias is None else o_proj_bias
        )
        self.q_norm = norm_cls(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = norm_cls(head_dim, rms_norm_eps) if qk_norm else None
        # Swappable core op (context parallel); a plain function attribute, not a submodule.
        self.attn_op: AttentionOp = packed_causal_attention

    def forward(
        self, x: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor] | None, attn: AttentionInputs
    ) -> torch.Tensor:
        b, s, _ = x.shape
        gate = None
        if self.output_gate:
            q, gate = self.q_proj(x).view(b, s, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, s, self.num_heads * self.head_dim)
        else:
            q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, k, *rope)
        out = self.attn_op(q, k, v, attn).reshape(b, s, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
