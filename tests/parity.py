"""Per-parameter gradient snapshots for parity checks: every parameter's full gradient by its HF name.

A norm can hide a wrong gradient on one expert shard or one router; these compare each parameter. Under FSDP2 /
EP a gradient is a DTensor shard: ``full_tensor()`` gathers it (a collective, so every rank must snapshot the same
parameters in the same order, which ``named_parameters`` gives).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

CHECKPOINT_PREFIX = "._checkpoint_wrapped_module"


def gradient_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (fp64 on CPU), keyed by its name without activation-checkpoint wrappers;
    a parameter without a gradient maps to an empty tensor."""
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            out[name.replace(CHECKPOINT_PREFIX, "")] = torch.empty(0)
            continue
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        out[name.replace(CHECKPOINT_PREFIX, "")] = full.detach().to(device="cpu", dtype=torch.float64)
    return out


def max_gradient_difference(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute difference over every parameter's gradient (the same names on both sides)."""
    if actual.keys() != expected.keys():
        raise AssertionError(f"parameter names differ: {sorted(set(actual) ^ set(expected))}")
    worst = 0.0
    for name, value in actual.items():
        if value.shape != expected[name].shape:
            raise AssertionError(f"{name}: gradient shape {tuple(value.shape)} vs {tuple(expected[name].shape)}")
        if value.numel():
            worst = max(worst, (value - expected[name]).abs().max().item())
    return worst
