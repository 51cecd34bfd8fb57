"""torchrun worker (4 gloo ranks): SAC under every FSDP2 layout, one launch, many cells.

Each cell builds the tiny Qwen3-MoE recipe fresh through the production path (``parallelize`` ->
``materialize_and_init`` -> ``nemo_ac.trainer.build.build_trainer``), trains ``train.steps`` steps and reports losses
and, against the no-AC reference of its EP size and dtype, the largest difference over every parameter's gradient
after step 1 (``tests.parity``), or the error it raised. Rank 0 writes ``{"cells": [...]}`` as JSON to ``argv[1]``.
Cell groups (``argv[2]``, comma separated):

- ``regression``: explicit prefetch with the workarounds off / with only the profiler-op ignore / on;
- ``matrix``: {placement inside, outside} x {forward prefetch none, explicit} x {backward prefetch default,
  explicit} x {ep 1, 2} x {fp32, bf16 params} in selective mode, plus the no-AC references and full AC.

ep 2 is the real expert-parallel dispatcher (``all_to_all_single`` with uneven splits inside the checkpointed
block) over 2 of the 4 ranks, the experts' FSDP unit sharded over the other 2 (ep_shard 2); dense weights are
sharded over all 4.
"""

from __future__ import annotations

import itertools
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils import checkpoint as torch_checkpoint

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.config.schema import DistConfig
from nemo_ac.data.loader import SyntheticBatches
from nemo_ac.distributed.mesh import build_meshes
from nemo_ac.distributed.parallelize import parallelize
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.runtime import destroy_distributed, exit_process, init_distributed
from nemo_ac.trainer.build import TrainingSetup, build_trainer, decide_recipe_plan, quiet_logger
from nemo_ac.trainer.optim import build_optimizer, build_scheduler
from nemo_ac.workarounds.profiler_ops_in_sac import ensure_profiler_ops_sac_ignored
from tests.parity import gradient_snapshot, max_gradient_difference

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"
# 2 steps of 2 micro batches per rank; seq_len 96 differs from every model dimension (64, 16, 32, 4).
BASE = ["train.steps=2", "train.warmup_steps=1", "train.global_batch_size=8", "train.micro_batch_size=2"]


_MESHES: dict = {}


def _meshes(layout):
    """Every cell has the same layout: build its meshes (process subgroups) once."""
    if layout not in _MESHES:
        _MESHES[layout] = build_meshes(layout, device_type="cpu")
    return _MESHES[layout]


# (ep, dtype) -> every parameter's gradient after step 1 of the no-AC reference
_REFERENCE_GRADS: dict[tuple[int, str], dict[str, torch.Tensor]] = {}


def train_cell(name: str, overrides: list[str], *, ep: int = 1, profiler_only: bool = False) -> dict:
    """Train one layout from scratch; never raises (errors are part of the result)."""
    ignored_before = set(torch_checkpoint.SAC_IGNORED_OPS)
    result: dict = {"name": name, "overrides": overrides, "ep": ep, "profiler_only": profiler_only}
    try:
        recipe = load_recipe(str(RECIPE), [*BASE, f"parallel.ep={ep}", *overrides])
        layout = validate_recipe(recipe, world_size=dist.get_world_size())
        meshes = _meshes(layout)
        torch.manual_seed(recipe.train.seed)
        model = build_model(recipe.model)
        plan = decide_recipe_plan(
            model, recipe, kernels=None, ep=layout.ep, cp=layout.cp, device_type=meshes.device_type
        )
        plan = parallelize(model, plan=plan, meshes=meshes)
        if profiler_only:
            ensure_profiler_ops_sac_ignored()
        materialize_and_init(model, device="cpu", seed=recipe.train.seed)
        optimizer = build_optimizer(model, recipe.train, device_type="cpu")
        setup = TrainingSetup(
            recipe=recipe,
            layout=layout,
            meshes=meshes,
            device=torch.device("cpu"),
            model=model,
            plan=plan,
            optimizer=optimizer,
            scheduler=build_scheduler(optimizer, recipe.train),
            data=SyntheticBatches(
                recipe.data,
                vocab_size=recipe.model.vocab_size,
                global_batch_size=recipe.train.global_batch_size,
                micro_batch_size=recipe.train.micro_batch_size,
                dp_rank=meshes.dp_rank,
                dp_size=meshes.dp_size,
                seed=recipe.train.seed,
            ),
            weights="random init",
            frozen={},
        )
        trainer = build_trainer(setup, logger=quiet_logger(recipe))
        grads: dict[str, torch.Tensor] = {}
        real_step = optimizer.step

        def step(*args, **kwargs):
            if not grads:
                grads.update(gradient_snapshot(model))
            return real_step(*args, **kwargs)

        optimizer.step = step
        history = trainer.fit()
        result.update(ok=True, losses=[m.loss for m in history], grad_norms=[m.grad_norm for m in history])
        key = (ep, recipe.parallel.fsdp.param_dtype)
        if recipe.activation_checkpointing.mode == "none":
            _REFERENCE_GRADS[key] = grads
        elif key in _REFERENCE_GRADS:
            result["max_grad_diff"] = max_gradient_difference(grads, _REFERENCE_GRADS[key])
    except Exception as exc:  # the regression cells expect the SAC error
        cause = exc.__cause__
        result.update(
            ok=False,
            error_type=type(exc).__name__,
            error=str(exc)[:3000],
            op=getattr(exc, "op", None),
            origin=getattr(getattr(exc, "origin", None), "kind", None),
            region=getattr(exc, "region", None),
            cause_type=type(cause).__name__ if cause is not None else None,
            cause=str(cause)[:1000] if cause is not None else None,
            traceback=traceback.format_exc()[-3000:],
        )
    finally:
        # Leave torch's global set as this process found it (cells must not leak into each other).
        torch_checkpoint.SAC_IGNORED_OPS.clear()
        torch_checkpoint.SAC_IGNORED_OPS.update(ignored_before)
        dist.barrier()
    return result


def regression_cells() -> list[dict]:
    selective = ["activation_checkpointing.mode=selective"]
    explicit = ["parallel.fsdp.forward_prefetch=explicit", "parallel.fsdp.backward_prefetch=explicit"]
    off = ["activation_checkpointing.workarounds=false"]
    return [
        train_cell("explicit/off", [*selective, *explicit, *off]) | {"kind": "regression"},
        train_cell("explicit/profiler_only", [*selective, *explicit, *off], profiler_only=True)
        | {"kind": "regression"},
        train_cell("explicit/on", [*selective, *explicit]) | {"kind": "regression"},
    ]


def matrix_cells() -> list[dict]:
    cells = []
    for ep, dtype in itertools.product((1, 2), ("float32", "bfloat16")):
        cells.append(
            train_cell(
                f"reference/ep={ep}/{dtype}",
                ["activation_checkpointing.mode=none", f"parallel.fsdp.param_dtype={dtype}"],
                ep=ep,
            )
            | {"kind": "reference", "dtype": dtype, "mode": "none"}
        )
    axes = itertools.product(
        ("inside", "outside"), ("none", "explicit"), ("default", "explicit"), (1, 2), ("float32", "bfloat16")
    )
    for placement, forward, backward, ep, dtype in axes:
        overrides = [
            "activation_checkpointing.mode=selective",
            f"activation_checkpointing.placement={placement}",
            f"parallel.fsdp.forward_prefetch={forward}",
            f"parallel.fsdp.backward_prefetch={backward}",
            f"parallel.fsdp.param_dtype={dtype}",
        ]
        name = f"selective/{placement}/fwd={forward}/bwd={backward}/ep={ep}/{dtype}"
        cells.append(train_cell(name, overrides, ep=ep) | {"kind": "selective", "dtype": dtype})
    for placement in ("inside", "outside"):
        overrides = [
            "activation_checkpointing.mode=full",
            f"activation_checkpointing.placement={placement}",
            "parallel.fsdp.forward_prefetch=explicit",
            "parallel.fsdp.backward_prefetch=explicit",
        ]
        cells.append(train_cell(f"full/{placement}/explicit", overrides, ep=2) | {"kind": "full", "dtype": "float32"})
    # The recompute on another thread (what CUDA's autograd device thread does): the FSDP brackets are per thread.
    threaded = [
        "activation_checkpointing.mode=selective",
        "activation_checkpointing.placement=outside",
        "parallel.fsdp.forward_prefetch=explicit",
        "parallel.fsdp.backward_prefetch=explicit",
        "train.backward_on_thread=true",
    ]
    cells.append(
        train_cell("selective/outside/explicit/backward_thread", threaded, ep=2)
        | {"kind": "selective", "dtype": "float32"}
    )
    return cells


def main() -> int:
    out_path, groups = Path(sys.argv[1]), sys.argv[2].split(",")
    init_distributed(DistConfig(backend="gloo", device="cpu", timeout_s=120))
    try:
        cells = []
        if "regression" in groups:
            cells += regression_cells()
        if "matrix" in groups:
            cells += matrix_cells()
        if dist.get_rank() == 0:
            out_path.write_text(json.dumps({"torch": torch.__version__, "cells": cells}, indent=1))
    finally:
        destroy_distributed(synchronize=sys.exc_info()[0] is None)  # no barrier on an error path
    return 0


if __name__ == "__main__":
    exit_process(main())
