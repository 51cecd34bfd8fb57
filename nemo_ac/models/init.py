"""Deterministic, world-size-independent initialization of a model built on the meta device.

Every parameter and buffer is generated as its FULL tensor on CPU from a ``torch.Generator`` seeded by
``(seed, crc32(canonical name))`` and then copied into whatever this rank holds: the whole tensor, or, for a
DTensor (FSDP2 / expert-parallel sharding), the local shard cut by ``distribute_tensor(..., src_data_rank=None)``
(no communication: every rank built the same full tensor). Hence the same seed gives bitwise-identical weights for
world size 1 and any sharding. Tensors are generated one at a time so peak host memory is one full tensor.

Names are canonicalized (wrapper components such as ``_checkpoint_wrapped_module`` / ``_orig_mod`` are dropped)
so wrapping a block with activation checkpointing or torch.compile before init does not change its weights.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from nemo_ac.models.layers.rmsnorm import RMSNorm

# Module path components inserted by wrappers; they are not part of a parameter's identity.
_WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})

# (canonical name, owning module, tensor, init_std, generator) -> full fp32 CPU tensor.
InitRule = Callable[[str, nn.Module, torch.Tensor, float, torch.Generator], torch.Tensor]


def canonical_name(name: str) -> str:
    """``layers.0._checkpoint_wrapped_module.mlp.gate.weight`` -> ``layers.0.mlp.gate.weight``."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_COMPONENTS)


def tensor_seed(seed: int, name: str) -> int:
    """Stable per-tensor seed (crc32 is stable across processes and Python versions, unlike ``hash``)."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode("utf-8"))) % (2**63)


def default_init_rule(
    name: str, module: nn.Module, tensor: torch.Tensor, init_std: float, generator: torch.Generator
) -> torch.Tensor:
    """Transformers-style init: normal(0, init_std) for linear / embedding / expert / router weights, ones for
    norm scales, zeros for biases; buffers come from the owning module's ``initial_buffer(name)``, and a module with
    its own scheme (Mamba's A_log / D / dt_bias, gated norms) says so via ``initial_parameter(name, generator)``
    returning a full tensor (or None to fall back to the rules here)."""
    local = name.rsplit(".", 1)[-1]
    if not isinstance(tensor, nn.Parameter):
        initial = getattr(module, "initial_buffer", None)
        if initial is None:
            raise ValueError(f"no init rule for buffer {name!r} (module {type(module).__name__} has no initial_buffer)")
        return initial(local).to(torch.float32)
    shape = tuple(tensor.shape)
    initial_parameter = getattr(module, "initial_parameter", None)
    if initial_parameter is not None:
        value = initial_parameter(local, generator)
        if value is not None:
            return value.to(torch.float32)
    if isinstance(module, RMSNorm):
        return torch.ones(shape)
    if local == "bias":
        return torch.zeros(shape)
    return torch.empty(shape).normal_(0.0, init_std, generator=generator)


# Families whose tensors need a rule of their own (none today): every family's special tensors (router bias buffer,
# Mamba's A_log / D / dt_bias, gated and zero-centered norms, vision LayerNorms) carry initial_buffer /
# initial_parameter hooks, so a family missing here gets ``default_init_rule`` and a new family edits nothing.
INIT_RULES: dict[str, InitRule] = {}


def _owner(model: nn.Module, name: str) -> nn.Module:
    prefix = name.rpartition(".")[0]
    return model.get_submodule(prefix) if prefix else model


def copy_full_into(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copies a full (unsharded) tensor into ``dst``: all of it, or this rank's shard when ``dst`` is a DTensor.

    ``src_data_rank=None`` makes ``distribute_tensor`` slice locally without communication: every rank holds
    ``full`` (generated from the same seed, or read from the same checkpoint file).
    """
    if isinstance(dst, DTensor):
        shard = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
        dst.to_local().copy_(shard.to(device=dst.device, dtype=dst.dtype))
    else:
        dst.copy_(full.to(device=dst.device, dtype=dst.dtype))


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int, init_std: float | None = None, family: str | None = None) -> None:
    """(Re)initialize every parameter and buffer of an already materialized model, deterministically."""
    cfg = getattr(model, "config", None)
    std = init_std if init_std is not None else getattr(cfg, "init_std", 0.02)
    rule = INIT_RULES.get(family or getattr(cfg, "family", ""), default_init_rule)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, tensor in tensors:
        canon = canonical_name(name)
        generator = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, canon))
        full = rule(canon, _owner(model, name), tensor, std, generator)
        if tuple(full.shape) != tuple(tensor.shape):
            raise ValueError(f"init rule built {tuple(full.shape)} for {name!r} of shape {tuple(tensor.shape)}")
        copy_full_into(tensor, full)


def to_empty_placed(
    model: nn.Module, *, device: torch.device | str, parameter_device: torch.device | str | None = None
) -> None:
    """``model.to_empty(device)``; with ``parameter_device`` the parameters there and the buffers on ``device``.

    FSDP2's ``CPUOffloadPolicy`` (``train.optimizer_offload: full``) keeps the sharded parameters on the host and
    refuses any other placement at its lazy init ("FSDP parameters should be materialized on CPU when enabling CPU
    offloading"), while buffers (RoPE tables, router correction biases) are read by the device's kernels directly.
    """
    if parameter_device is None or torch.device(parameter_device) == torch.device(device):
        model.to_empty(device=device)
        return
    model.to_empty(device=parameter_device)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def materialize_and_init(
    model: nn.Module,
    *,
    device: torch.device | str,
    seed: int,
    init_std: float | None = None,
    family: str | None = None,
    parameter_device: torch.device | str | None = None,
) -> nn.Module:
    """``to_empty(device)`` then ``init_weights``. Works before or after fully_shard / EP sharding.

    ``init_std`` and ``family`` default to ``model.config`` (the ``ModelConfig`` the builder stored);
    ``parameter_device``: where the parameters live when not on ``device`` (``to_empty_placed``).
    """
    to_empty_placed(model, device=device, parameter_device=parameter_device)
    tie = getattr(model, "tie_weights", None)
    cfg = getattr(model, "config", None)
    if tie is not None and getattr(cfg, "tie_word_embeddings", False):
        tie()  # to_empty may replace tied parameters by two separate tensors
    init_weights(model, seed=seed, init_std=init_std, family=family)
    return model
