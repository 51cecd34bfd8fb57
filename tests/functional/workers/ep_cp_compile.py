"""torchrun worker: train a recipe through the production path while recording every Dynamo compile per thread.

``python ep_cp_compile.py OUT.json key=value ...`` (under torchrun) builds the tiny recipe with the overrides exactly
as ``nemo_ac.train`` does (``parallelize`` -> ``materialize_and_init`` -> ``Trainer`` with the CP batch preparer),
and after each step snapshots how many frames Dynamo compiled so far on each thread (a compile-start callback that
records ``threading.current_thread().name``; the trainer's backward thread is ``nemo_ac-backward``). Rank 0 writes
``{"losses", "grad_norms", "compiles": [{thread: count} after step 1, 2, ...]}``.

If a feature the recipe asks for is not available yet (``NotImplementedError`` from ``parallelize``, e.g. compile
before its issue lands), rank 0 writes ``{"pending": message}`` and the test skips with that message.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
from pathlib import Path

import torch
import torch._dynamo.callback as dynamo_callback
import torch.distributed as dist

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.data.loader import SyntheticBatches
from nemo_ac.distributed.env import destroy_distributed, init_distributed
from nemo_ac.distributed.mesh import build_meshes
from nemo_ac.distributed.parallelize import parallelize
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.trainer.batching import make_batch_preparer
from nemo_ac.trainer.loop import LoopOptions, Trainer
from nemo_ac.trainer.metrics import MetricsLogger
from nemo_ac.trainer.optim import build_optimizer, build_scheduler

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"


class CompileCounter:
    """Dynamo frame compiles per thread name (a start callback runs on the compiling thread)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, args: dynamo_callback.CallbackArgs) -> None:
        with self._lock:
            self.counts[f"{threading.current_thread().name}:{args.callback_trigger.name}"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def main(out_path: str, overrides: list[str]) -> int:
    recipe = load_recipe(str(RECIPE), overrides)
    env = init_distributed(recipe.dist)
    layout = validate_recipe(recipe, world_size=env.world_size)
    counter = CompileCounter()
    dynamo_callback.callback_handler.register_start_callback(counter)
    result: dict = {}
    try:
        meshes = build_meshes(layout, device_type=env.device.type)
        torch.manual_seed(recipe.train.seed)
        model = build_model(recipe.model)
        try:
            parallelize(
                model,
                meshes=meshes,
                model_config=recipe.model,
                parallel=recipe.parallel,
                activation_checkpointing=recipe.activation_checkpointing,
                compile=recipe.compile,
                backend=recipe.backend,
            )
        except NotImplementedError as exc:
            result = {"pending": str(exc)}
            return 0
        materialize_and_init(model, device=env.device, seed=recipe.train.seed)
        optimizer = build_optimizer(model, recipe.train)
        trainer = Trainer(
            model=model,
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
            prepare_batch=make_batch_preparer(cp=layout.cp, cp_rank=meshes.cp_rank, cp_type=recipe.parallel.cp_type),
            device=env.device,
            logger=MetricsLogger(
                run_dir="unused",
                total_steps=recipe.train.steps,
                enabled=False,
                jsonl=False,
                progress_bar="never",
                log_every=1,
            ),
            options=LoopOptions(
                steps=recipe.train.steps,
                grad_clip=recipe.train.grad_clip,
                aux_loss_coef=recipe.model.moe.aux_loss_coef,
                backward_on_thread=recipe.train.backward_on_thread,
                metric_sources={"compiles": counter.snapshot},
            ),
            loss_group=meshes.loss_group,
        )
        history = trainer.fit()
        result = {
            "losses": [m.loss for m in history],
            "grad_norms": [m.grad_norm for m in history],
            "compiles": [m.extra["compiles"] for m in history],
        }
        return 0
    finally:
        dynamo_callback.callback_handler.remove_start_callback(counter)
        if dist.get_rank() == 0 and result:
            Path(out_path).write_text(json.dumps(result))
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
