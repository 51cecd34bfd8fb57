"""AdamW with decoupled weight decay groups, warmup + cosine LR, and gradient clipping across meshes."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_ac.config.schema import TrainConfig
from nemo_ac.config.targets import instantiate
from nemo_ac.trainer.adamw_low_precision import AdamWLowPrecision
from nemo_ac.trainer.host_optimizer_states import AdamWHostStates

# train.optimizer_state_dtype -> the dtype AdamWLowPrecision keeps the moments in (float8: block-wise e4m3).
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8": torch.float8_e4m3fn}


def adamw_implementation(device_type: str) -> Literal["fused", "foreach"]:
    """The built-in AdamW's kernel on ``device_type``: fused on CUDA, foreach elsewhere.

    foreach AdamW computes the update through lists of temporaries, one the size of every fp32 parameter this rank
    holds (24.9 GiB at GLM-4.5-Air's optimizer step on 16 ranks, that step's peak); the fused kernel updates each
    parameter in place and allocates none. On CPU foreach stays: every CPU test and reference run was written
    against it, and host memory is not the limit there. The dry run plans with the implementation of the device it
    plans for, so its peak is the one that will run.
    """
    return "fused" if device_type == "cuda" else "foreach"


def build_optimizer(
    model: nn.Module, config: TrainConfig, *, device_type: str, extensions: Sequence[str] = (), host: str = "cpu"
) -> torch.optim.Optimizer:
    """Frozen parameters (requires_grad False) get no optimizer state. Norm weights, biases and router correction
    biases (< 2 dims) get no weight decay. ``extensions``: the recipe's extensions.allow (user module prefixes).
    ``device_type``: where the step runs, which picks the built-in AdamW's kernel (``adamw_implementation``).
    ``host``: where ``train.optimizer_offload: states`` keeps the states ("meta" in the dry run)."""
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
    fused = adamw_implementation(device_type) == "fused"
    if config.optimizer_state_dtype != "float32" or config.master_dtype == "bfloat16":
        return AdamWLowPrecision(
            groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay,
            state_dtype=STATE_DTYPES[config.optimizer_state_dtype],
            seed=config.seed, fused=fused,
        )  # fmt: skip
    if config.optimizer_offload == "states":
        return AdamWHostStates(groups, host=host, fused=fused, lr=config.lr, betas=tuple(config.betas), eps=config.eps)
    return torch.optim.AdamW(
        groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps, foreach=not fused, fused=fused or None
    )


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


SCHEDULE_KEYS = ("steps", "warmup_steps", "lr", "min_lr_ratio", "scheduler")


def schedule_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``train.<key>: checkpoint A, recipe B`` for each LR-schedule key that differs (``saved`` / ``current``: the
    ``train`` section of the checkpoint's recipe and of this run's). Keys the checkpoint lacks are not compared."""
    return [
        f"train.{key}: checkpoint {saved[key]!r}, recipe {current.get(key)!r}"
        for key in SCHEDULE_KEYS
        if key in saved and saved[key] != current.get(key)
    ]


def builtin_lr(step: int, train: dict[str, Any]) -> float:
    """The built-in schedule's LR for the step after ``step`` completed steps, from a ``train`` section dict."""
    return train["lr"] * warmup_cosine(
        step, warmup_steps=train["warmup_steps"], total_steps=train["steps"], min_lr_ratio=train["min_lr_ratio"]
    )


def rebase_schedule(
    scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer, *, lr: float
) -> None:
    """After ``load_state_dict`` of a checkpoint made with another schedule: continue on this run's schedule.

    The restored LambdaLR keeps the checkpoint's ``base_lrs`` (so a changed ``train.lr`` would be ignored) and the
    optimizer keeps the checkpoint's current LR for the next step, after which the new lambda jumps in: the LR
    the issue measured (old value, then the new schedule scaled by the old peak). Here ``base_lrs`` become this
    run's ``lr`` and every group's LR this run's schedule at the restored step, so the next step already follows it.
    """
    step = scheduler.last_epoch
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(step)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


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
