"""Which part of a sharded tensor this rank holds, as a box of the global tensor, and moving only that part: the
bytes a rank reads from a safetensors file (``ReadStats``), and the shards it sends rank 0 on export.

Used by ``nemo_ac.trainer.checkpoint.hf_safetensors``: loading reads each tensor's box with safetensors' lazy
``get_slice`` instead of the whole tensor on every rank, and export gathers each tensor's shards on rank 0 instead of
all-gathering it everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@dataclass
class ReadStats:
    """Bytes this rank read out of the safetensors files (the tensors ``get_slice`` returned), and how many model
    tensors were read as a shard vs whole."""

    bytes_read: int = 0
    sharded: int = 0
    whole: int = 0

    def read(self, handle: Any, key: str, region: tuple[slice, ...] | None) -> torch.Tensor:
        lazy = handle.get_slice(key)
        tensor = lazy[region] if region is not None else lazy[:]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def local_region(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The box of the global tensor this rank holds (None: all of it, or a layout read whole).

    Per tensor dim, the indices this rank holds come from DTensor's own placement logic: an ``arange`` along that
    dim distributed with the placements that shard it (``Shard(d)``, and ``_StridedShard(d)``, which FSDP2 uses for
    the experts' dim 0 under EP), others replicated; ``src_data_rank=None`` slices locally, without communication.
    Contiguous indices give a slice; anything else (never seen with FSDP2 + EP) is read whole.
    """
    if not isinstance(tensor, DTensor):
        return None
    from torch.distributed.tensor import Replicate, distribute_tensor

    placements = tensor.placements
    if all(isinstance(p, Replicate) for p in placements):
        return None
    box = []
    for dim, size in enumerate(tensor.shape):
        on_dim = [p if getattr(p, "dim", None) == dim else Replicate() for p in placements]
        if all(isinstance(p, Replicate) for p in on_dim):
            box.append(slice(0, size))
            continue
        as_first = [p if isinstance(p, Replicate) else on_dim_zero(p) for p in on_dim]
        held = distribute_tensor(torch.arange(size), tensor.device_mesh, as_first, src_data_rank=None).to_local()
        if held.numel() == 0:
            box.append(slice(0, 0))
        elif torch.equal(held, torch.arange(int(held[0]), int(held[0]) + held.numel())):
            box.append(slice(int(held[0]), int(held[0]) + held.numel()))
        else:
            return None
    if tuple(s.stop - s.start for s in box) != tuple(tensor.to_local().shape):
        return None
    return tuple(box)


def on_dim_zero(placement: Any) -> Any:
    """The same shard placement on dim 0 (``_StridedShard`` keeps its split factor)."""
    if hasattr(placement, "split_factor"):
        return type(placement)(0, split_factor=placement.split_factor)
    return type(placement)(0)


def gather_to_writer(tensor: DTensor) -> torch.Tensor | None:
    """The full tensor on rank 0 (None elsewhere), each rank sending only its shard: one ``gather`` of the boxes
    (``local_region``) and one of the shards, padded to the largest, instead of an all-gather that would put the
    full tensor on every rank. Layouts without a box fall back to ``full_tensor()``. Collective over the world."""
    region = local_region(tensor)
    boxes = torch.tensor([v for s in region for v in (s.start, s.stop)] if region else [], dtype=torch.int64)
    local = tensor.to_local()
    device = local.device
    every_rank_has_a_box = torch.tensor([int(region is not None)], dtype=torch.int64, device=device)
    dist.all_reduce(every_rank_has_a_box, op=dist.ReduceOp.MIN)  # every rank takes the same path
    if not int(every_rank_has_a_box.item()):
        full = tensor.full_tensor()
        return full if dist.get_rank() == 0 else None
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = torch.tensor([local.numel()], dtype=torch.int64, device=device)
    dist.all_reduce(numel, op=dist.ReduceOp.MAX)
    flat = torch.zeros(int(numel), dtype=local.dtype, device=device)
    flat[: local.numel()] = local.reshape(-1)
    box_list = [torch.empty_like(boxes, device=device) for _ in range(world)] if rank == 0 else None
    data_list = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
    dist.gather(boxes.to(device), box_list, dst=0)
    dist.gather(flat, data_list, dst=0)
    if rank != 0:
        return None
    full = torch.empty(tuple(tensor.shape), dtype=local.dtype)
    for box, data in zip(box_list, data_list):
        bounds = box.tolist()
        slices = tuple(slice(bounds[i], bounds[i + 1]) for i in range(0, len(bounds), 2))
        shape = tuple(s.stop - s.start for s in slices)
        count = 1
        for n in shape:
            count *= n
        full[slices] = data[:count].reshape(shape).cpu()
    return full
