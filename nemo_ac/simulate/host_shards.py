"""What ``train.optimizer_offload: full`` adds to a GPU plan: the device copies of host shards, the host-link
traffic and the optimizer step on the host.

The dry run applies FSDP2's ``CPUOffloadPolicy`` as a run does, but its device is the CPU, so FSDP2's
``shard.to(device)`` before each all-gather and ``grad.to("cpu")`` after each reduce-scatter are no-ops that neither
the memory tracker nor the op counter sees. What a GPU run does instead, per FSDP unit (``fsdp_unit_shards``):

- each unshard copies the unit's fp32 shard to the device (forward once per micro batch; backward again when blocks
  reshard after forward; the root keeps its parameters gathered through backward), on FSDP's all-gather stream;
- each reduce-scatter's output is copied to the host gradient; the first micro batch's copy is asynchronous (pinned
  memory), later ones are waited for and added to the host gradient on the CPU (FSDP2 cannot run that add as a
  callback: ``_fsdp_collectives.foreach_reduce``);
- the optimizer step (clipping included) runs over host tensors, bound by the node's DRAM bandwidth.

The costs are added to the counted step as ``OpCost`` rows (``link`` "host", "host_blocking", "host_memory"), so
depth scaling scales them like every other counted quantity; the staging copies are a hand-added memory term.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FSDPModule

from nemo_ac.simulate.counters import StepCounts
from nemo_ac.simulate.memory import HandAdded, local_bytes
from nemo_ac.simulate.op_cost import OpCost

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class UnitShard:
    """One FSDP unit's local shard: all its parameters' bytes, the trainable ones', and whether it is the root."""

    bytes: int
    trainable_bytes: int
    root: bool


def fsdp_unit_shards(model: nn.Module) -> list[UnitShard]:
    """Each FSDP unit of ``model`` with the parameters it manages itself (a nested unit's are the nested unit's)."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    owner: dict[int, nn.Module] = {}
    for unit in units:  # pre-order: an inner unit overrides its parents
        for param in unit.parameters():
            owner[id(param)] = unit
    shards = []
    for unit in units:
        params = [param for param in unit.parameters() if owner[id(param)] is unit]
        shards.append(
            UnitShard(
                bytes=local_bytes(params),
                trainable_bytes=local_bytes(p for p in params if p.requires_grad),
                root=unit is model,
            )
        )
    return shards


def add_host_shard_costs(
    counts: StepCounts,
    units: list[UnitShard],
    *,
    micro_batches: int,
    reductions: int,
    reshard_after_forward: bool,
    reduce_dtype: str,
) -> None:
    """Append the host-link copies and the host-side work of one step (module docstring) to ``counts``, and move
    the update's ops (phase "optimizer", counted on the host tensors it steps) onto host memory.
    ``reductions``: reduce-scatters per step (every micro batch, or only the last one's)."""
    for cost in counts.costs:
        if cost.phase == "optimizer" and not cost.link:
            cost.link = "host_memory"
    forward = sum(unit.bytes for unit in units)
    backward = sum(unit.bytes for unit in units if not unit.root) if reshard_after_forward else 0
    reduced = sum(unit.trainable_bytes for unit in units) * _DTYPE_BYTES[reduce_dtype] // 4
    counts.costs.append(OpCost(0, forward, 0, "forward", weight=micro_batches, name="fsdp_shard_h2d", link="host"))
    if backward:
        counts.costs.append(
            OpCost(0, backward, 0, "backward", weight=micro_batches, name="fsdp_shard_h2d", link="host")
        )
    counts.costs.append(OpCost(0, reduced, 0, "backward", name="fsdp_grad_d2h", link="host"))
    if reductions > 1:
        later = reductions - 1
        counts.costs.append(OpCost(0, reduced, 0, "backward", weight=later, name="fsdp_grad_d2h", link="host_blocking"))
        # The host gradient += the copied one: read both, write one (fp32).
        trainable = sum(unit.trainable_bytes for unit in units)
        counts.costs.append(
            OpCost(0, 3 * trainable, 0, "backward", weight=later, name="host_grad_accumulate", link="host_memory")
        )


def staging_bytes(units: list[UnitShard]) -> HandAdded:
    """The device copies a step stages host shards through at once: two units' shards (the unit computing and
    the one prefetched) and one unit's reduced gradient waiting for its copy to the host; the largest unit's."""
    largest = max((unit.bytes for unit in units), default=0)
    largest_grad = max((unit.trainable_bytes for unit in units), default=0)
    return HandAdded(
        "host shard staging",
        2 * largest + largest_grad,
        "FSDP2 CPUOffloadPolicy: device copies of two units' shards and one reduced gradient (largest unit)",
    )


def describe(units: list[UnitShard], *, reductions: int) -> str:
    """The assumption line the report prints."""
    total = sum(unit.bytes for unit in units)
    return (
        f"optimizer_offload full: {total / 2**30:.2f} GiB of parameter shards per rank on the host, copied to the device "
        f"at each unshard and each gradient back ({reductions} reduce-scatter(s) per step, later ones waited for and "
        "added on the CPU); the update on the host at the node's DRAM bandwidth shared by its ranks"
    )
