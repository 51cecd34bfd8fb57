"""AdamW with decoupled weight decay groups, warmup + cosine LR, and gradient clipping across meshes."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_ac.config.schema import TrainConfig
from nemo_ac.config.targets import instantiate


def build_optimizer(model: nn.Module, config: TrainConfig, *, extensions: Sequence[str] = ()) -> torch.optim.Optimizer:
    """Frozen parameters (requires_grad False) get no optimizer state. Norm weights, biases and router correction
    biases (< 2 dims) get no weight decay. ``extensions``: the recipe's extensions.allow (user module prefixes)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]
    if config.optimizer is not None:
        return instantiate(config.optimizer, groups, key="train.optimizer", allow=extensions, lr=config.lr)
    return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps, foreach=True)


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier for ``step`` (0-based count of completed optimizer steps)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig, *, extensions: Sequence[str] = ()
) -> torch.optim.lr_scheduler.LRScheduler:
    if config.scheduler is not None:
        return instantiate(config.scheduler, optimizer, key="train.scheduler", allow=extensions)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: warmup_cosine(
            step, warmup_steps=config.warmup_steps, total_steps=config.steps, min_lr_ratio=config.min_lr_ratio
        ),
    )


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 grad norm over parameters that live on different device meshes (dense FSDP vs experts).

    torch's clip_grad_norm_ stacks per-parameter norms, which fails for DTensors on different meshes; here the
    norm is taken per mesh, made a full (all-reduced) tensor, then combined. Clips in place when max_norm > 0.
    """
    grads_by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for param in parameters:
        if param.grad is None:
            continue
        key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
        grads_by_mesh[key].append(param.grad)
    squares = []
    for grads in grads_by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    if not squares:
        return torch.zeros(())
    total = torch.stack(squares).sum().sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in grads_by_mesh.values():
            local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
            torch._foreach_mul_(local, coef.to(local[0].device))
    return total
