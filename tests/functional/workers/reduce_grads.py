"""torchrun worker: one recipe trained in both ``parallel.fsdp.reduce_grads`` modes, counting FSDP2's reduce-scatters.

``python reduce_grads.py OUT.json key=value ...`` (under torchrun) builds the tiny recipe with the overrides through
the production path (``nemo_ac.trainer.build``) once per mode, trains the same steps, and counts the reduce-scatter
collectives FSDP2 issues (a counting wrapper around ``torch.distributed``'s reduce-scatter entry that calls the real
one on the real gloo group). Rank 0 writes ``{mode: {"losses", "grad_norms", "reduce_scatters": [per step],
"micro_batches"}}``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import sys
from pathlib import Path

import torch.distributed as dist

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.runtime import destroy_distributed, exit_process, init_distributed
from nemo_ac.trainer.build import build_trainer, build_training, quiet_logger

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"
# FSDP2's reduce-scatter entry: reduce_scatter_single in torch 2.13+, reduce_scatter_tensor before.
ENTRY = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


class ReduceScatterCounter:
    def __init__(self) -> None:
        self.calls = 0
        real = getattr(dist, ENTRY)

        @functools.wraps(real)
        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        setattr(dist, ENTRY, counted)

    def snapshot(self) -> int:
        return self.calls


def main(out_path: str, overrides: list[str]) -> int:
    base = load_recipe(str(RECIPE), overrides)
    env = init_distributed(base.dist)
    layout = validate_recipe(base, world_size=env.world_size)
    counter = ReduceScatterCounter()
    result: dict = {}
    try:
        for mode in ("every_micro_batch", "last_micro_batch"):
            fsdp = dataclasses.replace(base.parallel.fsdp, reduce_grads=mode)
            recipe = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, fsdp=fsdp))
            setup = build_training(recipe, layout, device=env.device)
            trainer = build_trainer(setup, logger=quiet_logger(recipe), metric_sources={"rs": counter.snapshot})
            start = counter.snapshot()
            history = trainer.fit()
            totals = [start] + [m.extra["rs"] for m in history]
            result[mode] = {
                "losses": [m.loss for m in history],
                "grad_norms": [m.grad_norm for m in history],
                "reduce_scatters": [b - a for a, b in itertools.pairwise(totals)],
                "micro_batches": len(trainer.data.batches_for_step(1)),
            }
        return 0
    finally:
        if dist.get_rank() == 0 and result:
            Path(out_path).write_text(json.dumps(result))
        destroy_distributed(synchronize=sys.exc_info()[0] is None)  # no barrier on an error path


if __name__ == "__main__":
    exit_process(main(sys.argv[1], sys.argv[2:]))
