"""torchrun worker: train a recipe through the production path while recording every Dynamo compile per thread.

``python ep_cp_compile.py OUT.json key=value ...`` (under torchrun) builds the tiny recipe with the overrides exactly
as ``nemo_ac.train`` does (``nemo_ac.trainer.build``: parallelize -> materialize -> ``Trainer`` with the CP batch
preparer), and after each step snapshots how many frames Dynamo compiled so far on each thread (a compile-start callback that
records ``threading.current_thread().name``; the trainer's backward thread is ``nemo_ac-backward``). Rank 0 writes
``{"losses", "grad_norms", "compiles": [{thread: count} after step 1, 2, ...]}``.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
from pathlib import Path

import torch._dynamo.callback as dynamo_callback
import torch.distributed as dist

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.distributed.env import destroy_distributed, exit_process, init_distributed
from nemo_ac.trainer.build import build_trainer, build_training, quiet_logger

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
        setup = build_training(recipe, layout, device=env.device)
        trainer = build_trainer(setup, logger=quiet_logger(recipe), metric_sources={"compiles": counter.snapshot})
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
        destroy_distributed(synchronize=sys.exc_info()[0] is None)  # no barrier on an error path


if __name__ == "__main__":
    exit_process(main(sys.argv[1], sys.argv[2:]))
