"""Worker of tests/unit/compat/test_compat_automodel.py (one subprocess): a few training steps through NeMo Automodel's own SAC
context factory (``make_selective_checkpoint_context_fn()``), with nemo_ac's compat installed into that training.

``python -m tests.functional.workers.automodel_training`` prints one JSON line ``{run: {"losses": [...], "error": ...}}``:

- ``fsdp_none`` / ``fsdp_automodel``: FSDP2 at world size 1 (gloo) with a nested unit inside every checkpointed
  block (its router sharded on its own, as nemo_ac's fp32 router unit), eager, ``nemo_ac.compat.install()`` called; no AC vs.
  Automodel's ``checkpoint_wrapper(block, context_fn=<Automodel's factory>)``. Both must train and agree.
- ``compiled_none`` / ``compiled_automodel`` / ``compiled_nemo_ac``: AC(compile(block)) blocks with an experts loop
  (``tokens_per_group.tolist()``), trained with backward on another thread whose intra-op thread count differs
  (as the CUDA autograd device thread: Dynamo's per-thread config and the global-state guard miss). Automodel's
  factory alone fails with ``CheckpointError``; wrapped by ``nemo_ac.compat.automodel.automodel_selective_context_fn``
  it trains and matches the run without AC.

Its own process: importing Automodel applies its patches and its factory adds ops to torch's SAC_IGNORED_OPS.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.fsdp import fully_shard

from nemo_ac import compat
from nemo_ac.compat.automodel import automodel_ac_module, automodel_selective_context_fn
from nemo_ac.doctor.isolation import fresh_dynamo, on_thread, other_num_threads
from nemo_ac.doctor.probes_thread import FORWARD_CONFIG, HIDDEN, ROWS, ScalarSyncBlock

STEPS = 3
BLOCKS = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([ScalarSyncBlock() for _ in range(BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _wrap(net: Net, context_fn: Any) -> None:
    for index, layer in enumerate(net.layers):
        net.layers[index] = checkpoint_wrapper(
            layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=context_fn
        )


def _train(net: Net, *, backward_thread: bool) -> list[float]:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(10 + step))
        with torch._dynamo.config.patch(**FORWARD_CONFIG):
            loss = net(x).square().mean()
        if backward_thread:
            on_thread(loss.backward, num_threads=other_num_threads(), name="automodel-backward")
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def fsdp_run(ac: bool) -> list[float]:
    net = Net()
    for layer in net.layers:
        fully_shard(layer.router)
    if ac:
        _wrap(net, automodel_ac_module().make_selective_checkpoint_context_fn())
    for layer in net.layers:
        fully_shard(layer)
    fully_shard(net)
    return _train(net, backward_thread=False)


def compiled_run(ac: str) -> list[float]:
    net = Net()
    for layer in net.layers:
        layer.forward = torch.compile(layer.forward, backend="aot_eager", dynamic=False)
    if ac != "none":
        factory = automodel_ac_module().make_selective_checkpoint_context_fn()
        _wrap(net, automodel_selective_context_fn(factory) if ac == "nemo_ac" else factory)
    with fresh_dynamo():
        return _train(net, backward_thread=True)


def _attempt(fn, *args) -> dict[str, Any]:
    try:
        return {"losses": fn(*args), "error": None}
    except Exception as exc:
        return {"losses": None, "error": f"{type(exc).__name__}: {exc}"[:1500], "trace": traceback.format_exc()[-3000:]}


def main() -> None:
    status = compat.install()
    runs: dict[str, Any] = {"install": status.profiler_ops}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs["fsdp_none"] = _attempt(fsdp_run, False)
        runs["fsdp_automodel"] = _attempt(fsdp_run, True)
    finally:
        dist.destroy_process_group()
    for ac in ("none", "automodel", "nemo_ac"):
        runs[f"compiled_{ac}"] = _attempt(compiled_run, ac)
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
