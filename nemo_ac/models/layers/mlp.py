"""Dense feed-forward blocks with transformers' names.

``MLP`` is SwiGLU (gate_proj / up_proj / down_proj: Qwen3, GLM and their shared experts). ``NonGatedMLP`` is
``down(relu(up(x))^2)`` (up_proj / down_proj, optional biases: Nemotron-H dense layers and shared experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; also the shared expert of MoE layers."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Everything before ``down_proj`` (``MoE`` runs the two apart: ``MoE.shared_start``)."""
        return F.silu(self.gate_proj(x)) * self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))


class NonGatedMLP(nn.Module):
    """``down(relu(up(x))^2)``: Nemotron-H's squared-ReLU MLP (no gate projection)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Everything before ``down_proj`` (``MoE`` runs the two apart: ``MoE.shared_start``)."""
        return F.relu(self.up_proj(x)).square()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))
