"""The LM head and the token cross entropy over chunks of tokens: no [tokens, vocab] tensor at any time.

The plain path (``lm_head(hidden)`` then ``F.cross_entropy(logits.float(), ...)``) holds the logits in the
parameter dtype, their fp32 copy and the log-softmax saved for backward, and in backward their fp32 gradient:
about 10-14 bytes per token per vocabulary entry. At 16k tokens per rank and a 152k vocabulary that is 25-34 GiB,
the largest temporary of a step. Here the forward keeps only each token's log-sum-exp; the backward recomputes one
chunk's logits at a time (one more LM-head matmul per token, ``2 * hidden * vocab`` FLOPs) and turns them into the
hidden-state and weight gradients right away, so the peak is one chunk's logits: ``chunk_tokens * vocab * ~10``
bytes (0.6 GiB at 1024 tokens and a 152k vocabulary). Prime-rl, Liger and torchtune chunk the same way.

Exactness: each element follows the plain path's steps (the matmul in the weight's dtype, an fp32 upcast, an fp32
softmax, the gradient cast back to the weight's dtype), so in fp32 the loss and gradients equal the plain path's to
fp32 rounding. The weight gradient is accumulated over chunks in the weight's dtype (``addmm`` into it, as Liger does: no
fp32 copy of the weight); in bf16 that rounds once per chunk instead of once per micro batch.

Every op is an aten op (``mm``, ``logsumexp``, ``gather``, ``exp``), so FlopCounterMode, the memory trackers and
the dry run see this work, the backward's recompute included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Labels with no target: F.cross_entropy's default ignore_index (nemo_ac.data.batch.IGNORE_INDEX is the same).
IGNORE_INDEX = -100


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One chunk's logits in fp32, computed as the plain path does (matmul in the weight's dtype, then upcast)."""
    return F.linear(hidden, weight).float()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        lse = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            logits = _chunk_logits(hidden[start:end], weight)
            chunk_labels = labels[start:end]
            valid = chunk_labels != IGNORE_INDEX
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, chunk_labels.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(valid, chunk_lse - target, 0.0).sum()
            lse[start:end] = chunk_lse
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_tokens = chunk_tokens
        return total

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_total: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk_tokens: int = ctx.chunk_tokens
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden.shape[0])
            chunk_hidden = hidden[start:end]
            chunk_labels = labels[start:end]
            valid = chunk_labels != IGNORE_INDEX
            # d(lse - target)/d logits = softmax - one_hot(target), zero on ignored tokens, times the incoming grad.
            probs = _chunk_logits(chunk_hidden, weight).sub_(lse[start:end].unsqueeze(1)).exp_()
            probs.scatter_add_(1, chunk_labels.clamp(min=0).unsqueeze(1), -valid.unsqueeze(1).to(probs.dtype))
            probs.mul_((grad_total * valid).unsqueeze(1))
            grad_logits = probs.to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                # addmm with out= rather than addmm_: FlopCounterMode counts aten.addmm, not the in-place op.
                torch.addmm(grad_weight, grad_logits.t(), chunk_hidden, out=grad_weight)
        return grad_hidden, grad_weight, None, None


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")``
    without its [tokens, vocab] tensors: ``hidden`` [..., H], ``weight`` [V, H], ``labels`` [...] (IGNORE_INDEX
    where no target); at most ``chunk_tokens`` tokens' logits exist at once, in forward and in backward."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, labels.reshape(-1), chunk_tokens)
