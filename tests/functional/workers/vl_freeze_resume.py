"""torchrun worker (2 gloo ranks): the tiny Qwen3.6 MedPix recipe's frozen vision tower and its data position.

Every cell builds the recipe fresh through the production path (``nemo_ac.trainer.build``: ``parallelize`` ->
materialize -> ``freeze`` -> optimizer -> ``build_batches`` -> ``Trainer``), eager, at cp 2 x ep 2 on the 2 ranks
(FSDP shards dense weights over both, so gradients are reduce-scattered), and writes JSON to ``argv[1]`` (rank 0):

- ``frozen`` / ``trainable``: one step with ``train.freeze.vision_tower`` true / false, counting FSDP2's
  reduce-scatter calls and their input elements (a dispatch mode on the c10d ops), the optimizer's parameters and
  state, and which parameters the step changed;
- ``straight`` / ``resumed``: 3 steps saving a DCP checkpoint after step 2; then a new model, optimizer and MedPix
  loader resume from that checkpoint and train step 3 again. Same loss means the MedPix position (``plan_row``,
  ``plan_cursor``), weights and optimizer state came back (the recipe's AdamW states live on the host);
- ``on_device``: the ``straight`` run with ``train.optimizer_offload=none``: AdamW's states on the device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_ac.config import load_recipe, to_dict, validate_recipe
from nemo_ac.config.schema import DistConfig
from nemo_ac.models.freeze import parameter_groups
from nemo_ac.models.init import canonical_name
from nemo_ac.runtime import destroy_distributed, exit_process, init_distributed
from nemo_ac.trainer.build import build_trainer, build_training, quiet_logger
from nemo_ac.trainer.checkpoint.dcp import Checkpointer, TrainingState

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "tiny" / "qwen3_6_medpix_tiny.yaml"
BASE = [
    "parallel.cp=2",
    "parallel.ep=2",
    "compile.enabled=false",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.warmup_steps=1",
]


class ReduceScatterCounter(TorchDispatchMode):
    """Counts c10d reduce-scatter ops (FSDP2's gradient reduction) and the elements they reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and "reduce_scatter" in func.__name__:
            self.calls += 1
            tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            self.elements += tensors[1].numel()  # (output, input, ...): the input holds every gradient
        return func(*args, **(kwargs or {}))


def build(overrides: list[str], *, checkpoint_dir: Path | None = None, resume: str = "none"):
    recipe = load_recipe(str(RECIPE), [*BASE, *overrides])
    layout = validate_recipe(recipe, world_size=dist.get_world_size())
    setup = build_training(recipe, layout, device=torch.device("cpu"))
    trainer = build_trainer(setup, logger=quiet_logger(recipe))
    config = dataclasses.replace(
        recipe.checkpoint, enabled=checkpoint_dir is not None, dir=str(checkpoint_dir or "unused"), resume=resume
    )
    checkpointer = Checkpointer(
        config=config, total_steps=recipe.train.steps, recipe=to_dict(recipe), device=torch.device("cpu")
    )
    state = TrainingState(model=setup.model, optimizer=setup.optimizer, scheduler=setup.scheduler, data=setup.data)
    return trainer, checkpointer, state


def _padded(p: torch.Tensor, world: int) -> int:
    """Elements FSDP2 reduce-scatters for one parameter: dim 0 padded to a multiple of the shard count."""
    return math.ceil(p.shape[0] / world) * world * math.prod(p.shape[1:])


def freeze_cell(name: str, vision_tower: bool) -> dict:
    trainer, _, _ = build(["train.steps=1", f"train.freeze.vision_tower={str(vision_tower).lower()}"])
    model, optimizer = trainer.model, trainer.optimizer
    tower = {id(p) for p in parameter_groups(model)["vision_tower"]}
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    before = {id(p): p.detach().to_local().clone() for p in model.parameters()}
    counter = ReduceScatterCounter()
    with counter:
        metrics = trainer.train_step()
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    changed = {id(p) for p in model.parameters() if not torch.equal(p.detach().to_local(), before[id(p)])}
    changed_flags = torch.tensor([int(i in changed) for i in before], dtype=torch.int64)
    dist.all_reduce(changed_flags)  # a parameter changed if its shard changed on any rank
    changed = {i for i, flag in zip(before, changed_flags.tolist()) if flag}
    return {
        "name": name,
        "loss": metrics.loss,
        "reduce_scatter_calls": counter.calls,
        "reduce_scatter_elements": counter.elements,
        "tower_padded_elements": sum(_padded(p, dist.get_world_size()) for p in model.parameters() if id(p) in tower),
        "tower_params": len(tower),
        "tower_in_optimizer": sorted(names[i] for i in tower & in_optimizer),
        "tower_with_state": sorted(names[id(p)] for p in optimizer.state if id(p) in tower),
        "tower_changed": sorted(names[i] for i in tower & changed),
        "others_unchanged": sorted(names[i] for i in set(before) - tower - changed),
        "micro_batches": len(trainer.data.global_rows_of_micro_batches()),
    }


def _local_parameters(trainer) -> list[list[float]]:
    return [p.detach().to_local().flatten().tolist() for p in trainer.model.parameters()]


def resume_cells(tmp: Path) -> list[dict]:
    straight, checkpointer, state = build(["train.steps=3", "checkpoint.every_n_steps=2"], checkpoint_dir=tmp)
    losses = [m.loss for m in straight.fit(on_step_end=lambda step: checkpointer.on_step_end(step, state))]
    saved = state.data.state_dict()
    # The recipe keeps AdamW's states on the host (train.optimizer_offload: states); on the device, the same run.
    on_device, _, _ = build(["train.steps=3", "train.optimizer_offload=none"])
    on_device_losses = [m.loss for m in on_device.fit()]
    resumed, checkpointer, state = build(["train.steps=3"], resume=str(tmp / "step_2"))
    restored_step = checkpointer.restore(state)
    position = state.data.state_dict()
    resumed.step = restored_step
    history = resumed.fit()
    return [
        {
            "name": "straight",
            "losses": losses,
            "final_position": saved,
            "optimizer": type(straight.optimizer).__name__,
            "parameters": _local_parameters(straight),
        },
        {
            "name": "on_device",
            "losses": on_device_losses,
            "optimizer": type(on_device.optimizer).__name__,
            "parameters": _local_parameters(on_device),
        },
        {"name": "resumed", "restored_step": restored_step, "position": position, "losses": [m.loss for m in history]},
    ]


def main() -> int:
    out_path, tmp = Path(sys.argv[1]), Path(sys.argv[2])
    init_distributed(DistConfig(backend="gloo", device="cpu", timeout_s=120))
    try:
        cells = [freeze_cell("frozen", True), freeze_cell("trainable", False), *resume_cells(tmp)]
        if dist.get_rank() == 0:
            out_path.write_text(json.dumps({"cells": {c["name"]: c for c in cells}}, indent=1))
    finally:
        destroy_distributed(synchronize=sys.exc_info()[0] is None)  # no barrier on an error path
    return 0


if __name__ == "__main__":
    exit_process(main())
