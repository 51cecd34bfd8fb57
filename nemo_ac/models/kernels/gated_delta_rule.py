"""The gated delta rule over packed documents in pure torch: the default core of ``GatedDeltaNet.linear_attn_op``
(``nemo_ac.models.layers.gated_deltanet``, where the op's signature is spelled out) and the reference the fla kernel
runs off CUDA.

Packed documents: the conv never reads a token of another document and the recurrent state restarts at every
document start (a run of equal ``document_ids``), so a packed row computes exactly what each document computes alone.
The chunked form follows transformers' ``torch_chunk_gated_delta_rule`` (UT transform within chunks, a scan over
chunks) with the within-chunk decays masked to same-document pairs and the carried-in state masked for tokens whose
document starts inside the chunk. Tensor ops only (no ``.item()``), so torch.compile does not specialize on the
document layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nemo_ac.models.interfaces import AttentionInputs

ConvWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
LinearAttentionOp = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ConvWeights, AttentionInputs], torch.Tensor
]


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool, True at the first token of every run of equal document ids (and at position 0)."""
    first = torch.ones_like(document_ids[:, :1], dtype=torch.bool)
    return torch.cat((first, document_ids[:, 1:] != document_ids[:, :-1]), dim=1)


def _same_document(document_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """[B, S] bool: token t and token t - shift are in the same document (False for t < shift)."""
    same = document_ids[:, shift:] == document_ids[:, :-shift]
    return torch.cat((torch.zeros_like(same[:, :1]).expand(-1, shift), same), dim=1)


def _conv_taps(x: torch.Tensor, taps: tuple[torch.Tensor, ...], document_ids: torch.Tensor) -> torch.Tensor:
    """The masked causal depthwise conv before its SiLU (``taps[K-1]`` multiplies the current token)."""
    kernel, seq = len(taps), x.shape[1]
    out = x * taps[kernel - 1]
    # One padded copy; each earlier tap reads a view of it (a pad per tap would copy x K-1 times).
    padded = F.pad(x, (0, 0, 0, 0, kernel - 1, 0))
    for shift in range(1, min(kernel, seq)):
        prev = padded[:, kernel - 1 - shift : kernel - 1 - shift + seq]
        same = _same_document(document_ids, shift)[:, :, None, None]
        out = out + prev.masked_fill(~same, 0) * taps[kernel - 1 - shift]
    return out


class _PackedCausalConv1d(torch.autograd.Function):
    """The document-masked conv + SiLU with a backward that keeps only its input (and the small weight / ids).

    Written with autograd's own ops, the conv saved its padded input, one masked copy of it per earlier tap and the
    pre-SiLU output for backward: 5 input-sized tensors per q / k / v for the 4-tap kernel, where transformers'
    ``F.conv1d`` + SiLU keeps 2 (32 MiB more than transformers on the Qwen3.6 Gated DeltaNet row at 4096 tokens,
    bf16). The backward recomputes the pre-SiLU output from the input (K multiply-adds per element).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight, document_ids)
        return F.silu(_conv_taps(x, weight.to(x.dtype).unbind(-1), document_ids))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, document_ids = ctx.saved_tensors
        taps = weight.to(x.dtype).unbind(-1)
        kernel, seq = len(taps), x.shape[1]
        pre = _conv_taps(x, taps, document_ids)
        sig = torch.sigmoid(pre)
        grad_pre = grad_out * (sig * (1 + pre * (1 - sig)))  # d silu(y) / dy = s (1 + y (1 - s))
        del pre, sig
        grad_x = grad_pre * taps[kernel - 1] if ctx.needs_input_grad[0] else None
        grad_taps = [torch.zeros_like(t) for t in taps]
        grad_taps[kernel - 1] = (grad_pre * x).sum(dim=(0, 1))
        padded = F.pad(x, (0, 0, 0, 0, kernel - 1, 0))
        for shift in range(1, min(kernel, seq)):
            masked = grad_pre.masked_fill(~_same_document(document_ids, shift)[:, :, None, None], 0)
            prev = padded[:, kernel - 1 - shift : kernel - 1 - shift + seq]
            grad_taps[kernel - 1 - shift] = (masked * prev).sum(dim=(0, 1))
            if grad_x is not None:  # token t - shift receives tap (K-1-shift)'s share of token t's gradient
                grad_x[:, : seq - shift] += masked[:, shift:] * taps[kernel - 1 - shift]
        grad_w = torch.stack(grad_taps, dim=-1).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """SiLU of a causal depthwise conv over the sequence that never crosses a document boundary.

    x: [B, S, H, d]; weight: [H, d, K] (``weight[..., K-1]`` multiplies the current token, as in
    ``nn.Conv1d(padding=K-1)`` truncated to the first S outputs); document_ids: [B, S]. Returns [B, S, H, d].
    Only ``x`` (and the weight and ids) are kept for backward (``_PackedCausalConv1d``) when it runs eagerly.
    Inside a compiled graph the autograd form is traced instead: there AOTAutograd's partitioner decides what is
    saved, and a custom ``autograd.Function`` makes torch 2.13 bypass AOTAutograd's cache for the whole graph
    (counter ``autograd_cache_bypass``): a warm ``make run`` then re-traced its first Gated DeltaNet block graph (9 -> 27 s).
    """
    if torch.compiler.is_compiling():
        return F.silu(_conv_taps(x, weight.to(x.dtype).unbind(-1), document_ids))
    return _PackedCausalConv1d.apply(x, weight, document_ids)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 / bf16 / fp16 inputs, fp64 for fp64 (so fp64 parity tests check the math, not fp32 rounding)."""
    return torch.promote_types(dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    doc_starts: torch.Tensor | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule with state resets at document starts, in fp32 (fp64 for fp64 inputs).

    Recurrence per head: ``S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S_{t-1}' k_t))^T`` with the decayed state
    ``S_{t-1}' = exp(g_t) S_{t-1}``, output ``o_t = S_t^T q_t / sqrt(dk)``; ``S`` restarts from zero at every
    ``doc_starts`` token. q, k: [B, S, H, dk] (already L2-normalized), v: [B, S, H, dv], g, beta: [B, S, H],
    doc_starts: [B, S] bool or None (one document per row). Returns [B, S, H, dv] in q's dtype.

    ``initial_state`` [B, H, dk, dv] (fp32, default zero) is the state carried into position 0: only tokens before
    the row's first document start read it (none if ``doc_starts[:, 0]``). With ``output_final_state`` the return
    is ``(out, final)``, ``final`` [B, H, dk, dv] fp32 the state after the last token (it holds only the last
    document's tokens, plus the decayed initial state if no document starts in the row). Context parallel uses
    both to pass the state between sequence slices (``context_parallel.state_passing``).

    The chunk loop reads every per-chunk operand from one ``unbind`` (indexing ``t[:, :, i]`` per chunk made
    autograd allocate and accumulate a full-size zero gradient of ``t`` per chunk, O(n^2) traffic that dominated the
    backward).
    """
    out_dtype = q.dtype
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    acc = accumulation_dtype(q.dtype)
    # Contiguous [B, H, S, d] once (as transformers does): on the transposed views every chunk matmul below made and
    # saved its own contiguous copy of q, k^T (twice) and k * beta for backward.
    q, k, v = (t.transpose(1, 2).to(acc).contiguous() for t in (q, k, v))
    g, beta = (t.transpose(1, 2).to(acc) for t in (g, beta))
    q = q * dk**-0.5
    starts = torch.zeros(b, s, dtype=torch.bool, device=q.device) if doc_starts is None else doc_starts.to(q.device)
    pad = (-s) % c
    if pad:  # zero tokens after the end: no write (k = beta = 0), outputs dropped
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
        starts = torch.cat((starts, starts.new_zeros(b, pad)), dim=1)
    n = (s + pad) // c
    q, k, v = (t.reshape(b, h, n, c, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)

    # Segments inside each chunk: 0 = the document that was running when the chunk began (reads the carried state).
    seg = starts.reshape(b, 1, n, c).to(torch.int32).cumsum(-1)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    within = (seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal  # [B, 1, N, C, C]: j <= i, same document
    carried = seg == 0  # [B, 1, N, C]
    # Cumulative log-decay restarted at each document start (a masked sum: no cancellation across documents).
    cum = (within.to(acc) @ g.unsqueeze(-1)).squeeze(-1)  # [B, H, N, C]
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~within, float("-inf")).exp()

    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    read = cum.exp() * carried  # decay from the chunk start, 0 for documents that start inside the chunk
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, k_beta * read.unsqueeze(-1), upper=False, unitriangular=True)
    q_read = q * read.unsqueeze(-1)
    to_end = (cum[..., -1:] - cum).masked_fill(~within[..., -1, :], float("-inf")).exp()
    k_write = k * to_end.unsqueeze(-1)
    chunk_decay = read[..., -1]  # [B, H, N]

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    # Per-chunk views by one unbind each (see the docstring).
    values_in = new_values.unbind(2)
    cumdecay_in = k_cumdecay.unbind(2)
    write_in = k_write.transpose(-1, -2).unbind(2)
    decay_in = chunk_decay[..., None, None].unbind(2)
    q_in, intra_in = q_read.unbind(2), intra.unbind(2)
    outs = []
    for i in range(n):  # sequential over chunks: each reads the state the previous one left
        v_new = values_in[i] - cumdecay_in[i] @ state
        outs.append(q_in[i] @ state + intra_in[i] @ v_new)
        state = state * decay_in[i] + write_in[i] @ v_new
    out = torch.stack(outs, dim=2).reshape(b, h, n * c, dv)[:, :, :s].transpose(1, 2).contiguous().to(out_dtype)
    return (out, state) if output_final_state else out


def packed_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weights: ConvWeights,
    attn: AttentionInputs,
    *,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The default ``linear_attn_op`` (signature in the module docstring): document-masked conv + SiLU, GQA
    repeat of q/k to the value heads, L2 norm, chunked gated delta rule with document resets."""
    doc = attn.document_ids.to(q.device)
    wq, wk, wv = conv_weights
    q = packed_causal_conv1d(q, wq, doc)
    k = packed_causal_conv1d(k, wk, doc)
    v = packed_causal_conv1d(v, wv, doc)
    ratio = v.shape[2] // q.shape[2]
    if ratio > 1:
        q = q.repeat_interleave(ratio, dim=2)
        k = k.repeat_interleave(ratio, dim=2)
    q = l2norm(q.to(accumulation_dtype(q.dtype)))
    k = l2norm(k.to(accumulation_dtype(k.dtype)))
    out = chunk_gated_delta_rule(q, k, v, g, beta, doc_starts=document_starts(doc), chunk_size=chunk_size)
    return out.to(v.dtype)
