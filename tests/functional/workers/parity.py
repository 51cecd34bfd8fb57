"""torchrun worker: parity cells of one world size in one launch, each a short training run through the production
build, snapshotting every parameter's gradient (``tests.parity``).

``python parity.py OUT_DIR CELLS.json`` where CELLS.json is ``[{"name", "recipe", "overrides": [...],
"watch_dtypes": bool}, ...]``. Per
cell: build (``nemo_ac.trainer.build``), train ``train.steps`` steps, snapshot every parameter's full gradient just
before the first optimizer step, and record the losses, the grad norms, Dynamo compiles per thread after each step,
the compile accounting, and (``watch_dtypes``) the dtypes the router saw in its first forward (its weight: the unsharded parameter,
so its FSDP unit's mixed-precision dtype; its logits; its scores) beside the routed experts' weight and output. Rank 0 writes
``OUT_DIR/<name>.pt`` (the gradients) and ``OUT_DIR/cells.json``. A failing cell records its error and the launch
stops there (its collectives may be out of step).
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import traceback
from pathlib import Path

import torch
import torch._dynamo.callback as dynamo_callback
import torch.distributed as dist

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.diagnostics.recompiles import CompileAccounting
from nemo_ac.models.layers.experts import GroupedExperts
from nemo_ac.models.layers.router import TopKRouter
from nemo_ac.runtime import destroy_distributed, exit_process, init_distributed
from nemo_ac.trainer.build import build_trainer, build_training, quiet_logger
from tests.parity import gradient_snapshot

ROOT = Path(__file__).resolve().parents[3]


class CompileCounter:
    """Dynamo frame compiles per thread name (a start callback runs on the compiling thread; the trainer's
    backward thread is ``nemo_ac-backward``)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, args: dynamo_callback.CallbackArgs) -> None:
        with self._lock:
            self.counts[f"{threading.current_thread().name}:{args.callback_trigger.name}"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def _dtype(value: torch.Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")


def _watch_dtypes(model: torch.nn.Module) -> tuple[dict[str, str], list]:
    """Dtypes the first router and the first routed experts see in their first forward (the unsharded parameters
    then carry their FSDP unit's mixed-precision dtype)."""
    seen: dict[str, str] = {}
    router = next((m for m in model.modules() if isinstance(m, TopKRouter)), None)
    experts = next((m for m in model.modules() if isinstance(m, GroupedExperts)), None)
    handles = []
    # Pre-hooks run after FSDP's own (prepended) pre-forward hook: the parameters are unsharded then.
    if router is not None:

        def before_router(module, args):
            seen.setdefault("router_weight", _dtype(module.weight))
            seen.setdefault("router_logits", _dtype(module.logits(args[0].reshape(-1, module.hidden_size))))

        def after_router(module, args, out):
            seen.setdefault("router_scores", _dtype(out[0]))

        handles += [router.register_forward_pre_hook(before_router), router.register_forward_hook(after_router)]
    if experts is not None:

        def before_experts(module, args):
            seen.setdefault("experts_weight", _dtype(next(module.parameters())))

        def after_experts(module, args, out):
            seen.setdefault("experts_output", _dtype(out))

        handles += [experts.register_forward_pre_hook(before_experts), experts.register_forward_hook(after_experts)]
    return seen, handles


def run_cell(cell: dict, *, world_size: int, device: torch.device, out_dir: Path, rank: int) -> dict:
    torch._dynamo.reset()  # each cell compiles from scratch: no code cache or automatic-dynamic state from the last
    recipe = load_recipe(str(ROOT / "recipes" / cell["recipe"]), cell["overrides"])
    layout = validate_recipe(recipe, world_size=world_size)
    setup = build_training(recipe, layout, device=device)
    counter = CompileCounter()
    trainer = build_trainer(setup, logger=quiet_logger(recipe), metric_sources={"compiles": counter.snapshot})
    grads: dict[str, torch.Tensor] = {}
    real_step = setup.optimizer.step

    def step(*args, **kwargs):
        if not grads:
            grads.update(gradient_snapshot(setup.model))
        return real_step(*args, **kwargs)

    setup.optimizer.step = step
    # Opt-in: the hooks are traced into compiled blocks and their dict writes add guards (recompiles).
    seen, handles = _watch_dtypes(setup.model) if cell.get("watch_dtypes") else ({}, [])
    dynamo_callback.callback_handler.register_start_callback(counter)
    try:
        with CompileAccounting(watch_checkpoint_entries=setup.plan.applied.compiled_checkpoint_entries) as accounting:
            history = trainer.fit()
            compile_metrics = accounting.summary() if recipe.compile.enabled else {}
    finally:
        dynamo_callback.callback_handler.remove_start_callback(counter)
        for handle in handles:
            handle.remove()
    if rank == 0:
        torch.save(grads, out_dir / f"{cell['name']}.pt")
    return {
        "name": cell["name"],
        "ok": True,
        "world_size": world_size,
        "layout": str(layout),
        "dtype": recipe.parallel.fsdp.param_dtype,
        "losses": [m.loss for m in history],
        "grad_norms": [m.grad_norm for m in history],
        "compile": compile_metrics,
        "compiles_per_step": [m.extra["compiles"] for m in history],
        "dtypes": seen,
        "plan": setup.plan.summary_lines(),
    }


def main(out_dir: str, cells_path: str) -> int:
    cells = json.loads(Path(cells_path).read_text())
    out = Path(out_dir)
    first = load_recipe(str(ROOT / "recipes" / cells[0]["recipe"]), cells[0]["overrides"])
    env = init_distributed(first.dist)
    results: list[dict] = []
    ok = True
    try:
        for cell in cells:
            try:
                results.append(run_cell(cell, world_size=env.world_size, device=env.device, out_dir=out, rank=env.rank))
            except Exception as exc:
                results.append(
                    {"name": cell["name"], "ok": False, "error": repr(exc), "traceback": traceback.format_exc()}
                )
                ok = False
                break
            dist.barrier()
        return 0
    finally:
        if env.rank == 0:
            (out / "cells.json").write_text(json.dumps(results, indent=1))
        destroy_distributed(synchronize=ok)


if __name__ == "__main__":
    exit_process(main(sys.argv[1], sys.argv[2]))
