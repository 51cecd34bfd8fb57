"""RMSNorm with Hugging Face Qwen3 semantics.

The normalization runs in fp32 whatever the activation dtype, and the result is cast back to the input dtype
*before* the weight multiply (``weight * x.to(input_dtype)``). Matching that order exactly is what makes bf16
logits agree with transformers when a checkpoint is loaded.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale (initialized to ones)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
