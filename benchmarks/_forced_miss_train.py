"""``nemo_ac.train`` with backward on a worker thread that misses the forward's compile cache (a benchmark harness).

Usage (what benchmarks/recompiles.py launches)::

    torchrun --nproc-per-node 2 benchmarks/_forced_miss_train.py RECIPE key=value ...

Everything is the unmodified trainer (recipe validation, parallelize, FSDP2, CP, data, metrics.jsonl with the
per-thread compile counts) except one function: ``nemo_ac.trainer.loop.run_backward`` is replaced, for this process
only, by a version that runs ``loss.backward()`` on a new thread whose intra-op thread count differs from the
training thread's (``torch.set_num_threads``). ``num_threads`` is part of Dynamo's global-state guard, so an
``ac_outer`` recompute there misses the forward's cache entry and compiles on that thread with the thread's own
Dynamo config, which is what the CUDA autograd device thread does on a GPU. On CPU the trainer's own
``train.backward_on_thread`` thread has the same count as the training thread and hits the cache, so without this
the "forward-thread context off" failure cannot be observed in a CPU trainer run.
"""

from __future__ import annotations

import sys

import torch

import nemo_ac.trainer.loop as loop
from nemo_ac.doctor.isolation import on_thread, other_num_threads


def run_backward_forced_miss(loss: torch.Tensor, *, on_thread_requested: bool = True, **_: object) -> None:
    """``loss.backward()`` on a new thread at another intra-op thread count (restored afterwards)."""
    on_thread(loss.backward, num_threads=other_num_threads(), name="nemo_ac-backward-forced-miss")


def main() -> int:
    """Patch the trainer's backward runner, then run ``nemo_ac.train`` with this process's arguments."""
    loop.run_backward = run_backward_forced_miss
    from nemo_ac.train import main as train_main

    return train_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
