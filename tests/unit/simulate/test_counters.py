"""The dry run's op counter (``nemo_ac.simulate.counters``): what it charges an op."""

from __future__ import annotations

import torch

from nemo_ac.simulate.counters import StepCounter


def test_the_counter_counts_what_an_op_returning_nothing_writes() -> None:
    """``_fused_adamw_`` returns nothing: it reads parameters, gradients and both moments and writes what its schema
    marks written: the same four (the gradients for in-place unscaling; 32 bytes per fp32 parameter, an upper bound
    by 4 where no grad scaler runs). Counting outputs alone gave it 0 bytes, so a fused step cost no time."""
    params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(3)]
    for param in params:
        param.grad = torch.ones(1000)
    optimizer = torch.optim.AdamW(params, fused=True)
    counter = StepCounter()
    with counter, counter.phase("optimizer"):
        optimizer.step()
    fused = [cost for cost in counter.counts.costs if cost.name == "_fused_adamw_"]
    assert len(fused) == 1
    steps = 3 * 4  # the fp32 step counters (one scalar per parameter) are read as well
    assert fused[0].bytes == 32 * 3000 + steps
