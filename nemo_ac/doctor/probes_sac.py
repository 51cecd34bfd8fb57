"""SAC desync probes: FSDP2 units inside selective-AC regions, on the installed torch.

Both use the smallest model that has the layout: blocks ``a -> inner -> b`` whose ``inner`` linear is its own
``fully_shard`` unit (an MoE block's experts / fp32 router), each block, then the root sharded, every block run under
``checkpoint(..., use_reentrant=False, context_fn=<SAC>)``. The nested unit's output is not the block output, so
its pre-backward hook has not fired when the block recomputes: its forward hooks run again inside the recompute.

- ``profiler_ops`` (1 process): torch 2.13's FSDP2 runs those hooks under ``record_function``, so the recompute sees
  more ``profiler._record_function_*`` ops than the forward::

      RuntimeError: profiler._record_function_enter_new.default invocation index 2 encountered during backward but
      not found in storage.

  Without the workaround: torch's own ``create_selective_checkpoint_contexts`` (any SAC user's setup). With it:
  the same, after ``nemo_ac.compat.install()``.
- ``fsdp_prefetch`` (2 processes: at world size 1 FSDP2 has nothing to all-gather): with explicit forward
  prefetch the next block's nested unit is all-gathered by its predecessor's hook outside the region in forward,
  but by its own hook inside the region in recompute, so even with the profiler ops ignored::

      RuntimeError: fsdp.all_gather_copy_in.default encountered during backward but not found in storage

  Without the workaround: ``install()`` and ``compat.selective_checkpoint_context_fn``. With it: also
  ``compat.protect_fsdp_units(model)``.

With the workaround a probe must not only finish: its gradients must equal those of the same model without AC.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nemo_ac import compat
from nemo_ac.doctor.isolation import private_sac_ignored_ops
from nemo_ac.doctor.result import ProbeRun, recording

PROFILER_DESYNC = re.compile(r"profiler\._record_function_\w+\.\w+ (invocation index \d+ )?encountered during backward")
FSDP_DESYNC = re.compile(
    r"(fsdp\.\w+|c10d\._allgather_base_|aten\.empty\.memory_format)\.?\w* (invocation index \d+ )?"
    r"encountered during backward"
)
HIDDEN = 12
ROWS = 5  # never equal to HIDDEN (nothing here compiles, but keep the project's habit)


class NestedUnitBlock(nn.Module):
    """``b(relu(inner(a(x))))`` where ``inner`` becomes a nested FSDP2 unit (an op follows it in the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.inner = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.inner(self.a(x))))


class NestedUnitNet(nn.Module):
    """Blocks run under ``checkpoint(..., context_fn=self.context_fn)`` (None: no activation checkpointing)."""

    def __init__(self, *, num_blocks: int, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([NestedUnitBlock() for _ in range(num_blocks)])
        self.context_fn = context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.context_fn is None:
                x = layer(x)
            else:
                x = checkpoint(layer, x, use_reentrant=False, context_fn=self.context_fn)
        return x


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A user's SAC policy: save matmul outputs, recompute everything else."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def torch_sac_context_fn() -> Callable[[], Any]:
    """torch's own SAC modes with ``save_matmuls`` (what a plain FSDP2 trainer such as torchtitan builds)."""
    return functools.partial(create_selective_checkpoint_contexts, save_matmuls)


def shard_nested_unit_net(
    net: NestedUnitNet, *, device: torch.device, shard_blocks: bool = False, explicit_prefetch: bool = False
) -> NestedUnitNet:
    """fully_shard every nested unit, (each block,) then the root; with block units optionally explicit forward /
    backward prefetch of the next (previous) block together with its nested unit."""
    if explicit_prefetch and not shard_blocks:
        raise ValueError("explicit prefetch is set between block units: shard_blocks=True")
    net.to(device)
    blocks = []
    for layer in net.layers:
        fully_shard(layer.inner)
        if shard_blocks:
            blocks.append(fully_shard(layer))
    fully_shard(net)
    if explicit_prefetch:
        for i in range(len(blocks) - 1):
            blocks[i].set_modules_to_forward_prefetch([blocks[i + 1], blocks[i + 1].inner])
        for i in range(1, len(blocks)):
            blocks[i].set_modules_to_backward_prefetch([blocks[i - 1], blocks[i - 1].inner])
    return net


def nested_unit_grads(net: NestedUnitNet, *, device: torch.device) -> list[torch.Tensor]:
    """Forward + backward of a fixed batch; the full (unsharded) gradients."""
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device)
    net(x).square().mean().backward()
    return [p.grad.full_tensor().detach().cpu().clone() for p in net.parameters()]


def _matches(got: list[torch.Tensor], expected: list[torch.Tensor]) -> str:
    """'' when equal to fp32 round-off (SAC only changes what is replayed vs recomputed), else the worst error."""
    worst = max(float((g - e).abs().max()) for g, e in zip(got, expected))
    return "" if worst <= 1e-6 else f"gradients differ from no-AC by up to {worst:.3g}"


def _check_grads(run: ProbeRun, got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    mismatch = _matches(got, expected)
    run.facts["grads_match_no_ac"] = not mismatch
    if mismatch:
        raise AssertionError(mismatch)


def run_profiler_ops_probe(*, workaround: bool, device: str = "cpu", torch_version: str | None = None) -> ProbeRun:
    """Needs an initialized process group (world size 1 is enough). See the module docstring."""
    dev = torch.device(device)
    run = ProbeRun(workaround=workaround)
    expected = nested_unit_grads(shard_nested_unit_net(NestedUnitNet(num_blocks=2), device=dev), device=dev)
    # The private copy holds what torch ships (nothing nemo_ac added); the workaround installs into it.
    with private_sac_ignored_ops(upstream_only=True), _installed_if(workaround, torch_version=torch_version) as state:
        run.facts["profiler_ops"] = state.profiler_ops if state is not None else "off"
        with recording(run, expected=PROFILER_DESYNC):
            net = shard_nested_unit_net(NestedUnitNet(num_blocks=2, context_fn=torch_sac_context_fn()), device=dev)
            _check_grads(run, nested_unit_grads(net, device=dev), expected)
    return run


@contextmanager
def _installed_if(enabled: bool, *, torch_version: str | None) -> Iterator[compat.CompatStatus | None]:
    if not enabled:
        yield None
        return
    with compat.installed(torch_version=torch_version) as state:
        yield state


def run_fsdp_prefetch_rank(*, workaround: bool, device: str = "cpu", torch_version: str | None = None) -> ProbeRun:
    """One rank's part of the explicit-prefetch probe (every rank of a 2-process group runs it)."""
    dev = torch.device(device)
    run = ProbeRun(workaround=workaround, facts={"world_size": dist.get_world_size()})
    layout = {"shard_blocks": True, "explicit_prefetch": True}
    reference = shard_nested_unit_net(NestedUnitNet(num_blocks=3), device=dev, **layout)
    expected = nested_unit_grads(reference, device=dev)
    # Profiler ops ignored in both runs (the running torch's gate, not ``torch_version``): this probe isolates
    # FSDP's parameter management; only protect_fsdp_units is switched.
    with private_sac_ignored_ops(upstream_only=True), compat.installed():
        context_fn = compat.selective_checkpoint_context_fn(policy=save_matmuls, region="probe")
        net = shard_nested_unit_net(NestedUnitNet(num_blocks=3, context_fn=context_fn), device=dev, **layout)
        if workaround:
            run.facts["protected_units"] = compat.protect_fsdp_units(net, torch_version=torch_version)
        with recording(run, expected=FSDP_DESYNC):
            _check_grads(run, nested_unit_grads(net, device=dev), expected)
    return run
