"""The parity harness: every parameter's gradient and the loss of every step, against one process, with one
tolerance table.

A norm can hide a wrong gradient on one expert shard or one router, so parity compares each parameter's full
gradient by name (DTensor ``full_tensor()``, gathered on every rank: a collective, so every rank snapshots the same
parameters in the same order, which ``named_parameters`` gives) after the first step's backward, and the loss of
each step. Workers (``tests/functional/workers/parity.py``) write snapshots; tests compare them here.

Tolerances (``TOLERANCES``, relative: a parameter's max absolute difference over its gradient's max magnitude;
losses relative to the reference loss):
- fp64: 1e-10 (round-off of a different reduction order only);
- fp32: 1e-5;
- bf16 params with fp32 gradient reduction, parallel vs 1 process: 3e-2 for gradients, 1e-3 for losses: one
  process multiplies bigger row blocks than a sharded rank does, so bf16 products round differently, and inductor
  keeps some intermediates in fp32 where eager rounds them to bf16 (measured with EP2 x CP2 ring on 4 ranks:
  1.3e-2 eager, 1.8e-2 compiled, losses 8e-5; printed by ``pytest -s tests/functional/test_parity.py``);
- activation checkpointing on vs off, same layout and dtype (``AC_ON_VS_OFF``): bitwise equal, in eager (the
  recompute runs the same kernels on the same values) and, measured on CPU, under inductor too (bf16, EP2 x CP2
  ring, selective AC vs none, both compiled: 0.0). A GPU run may need a rounding bound there if inductor fuses the
  recompute differently; none is granted until one is measured.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.launch import ROOT, run_script

CHECKPOINT_PREFIX = "._checkpoint_wrapped_module"
PARITY_WORKER = ROOT / "tests" / "functional" / "workers" / "parity.py"


@dataclass(frozen=True)
class Tolerance:
    grad: float
    loss: float


TOLERANCES = {
    "float64": Tolerance(grad=1e-10, loss=1e-10),
    "float32": Tolerance(grad=1e-5, loss=1e-5),
    "bfloat16": Tolerance(grad=3e-2, loss=1e-3),
}
AC_ON_VS_OFF = Tolerance(grad=0.0, loss=0.0)


def gradient_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (fp64 on CPU), keyed by its name without activation-checkpoint wrappers;
    a parameter without a gradient maps to an empty tensor."""
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            out[name.replace(CHECKPOINT_PREFIX, "")] = torch.empty(0)
            continue
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        out[name.replace(CHECKPOINT_PREFIX, "")] = full.detach().to(device="cpu", dtype=torch.float64)
    return out


def _check_names(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    if actual.keys() != expected.keys():
        raise AssertionError(f"parameter names differ: {sorted(set(actual) ^ set(expected))}")
    for name, value in actual.items():
        if value.shape != expected[name].shape:
            raise AssertionError(f"{name}: gradient shape {tuple(value.shape)} vs {tuple(expected[name].shape)}")


def max_gradient_difference(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute difference over every parameter's gradient (the same names on both sides)."""
    _check_names(actual, expected)
    return max(((a - expected[n]).abs().max().item() for n, a in actual.items() if a.numel()), default=0.0)


def relative_gradient_differences(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """Per parameter: max |actual - expected| / max |expected| (0 where both are all zero)."""
    _check_names(actual, expected)
    out = {}
    for name, value in actual.items():
        if not value.numel():
            continue
        scale = expected[name].abs().max().item()
        diff = (value - expected[name]).abs().max().item()
        out[name] = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    return out


def max_relative_loss_difference(actual: list[float], expected: list[float]) -> float:
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} losses vs {len(expected)}")
    return max(abs(a - e) / max(abs(e), 1e-12) for a, e in zip(actual, expected))


def assert_parity(
    *,
    name: str,
    grads: Mapping[str, torch.Tensor],
    losses: list[float],
    reference_grads: Mapping[str, torch.Tensor],
    reference_losses: list[float],
    tolerance: Tolerance,
) -> tuple[float, float]:
    """Every parameter's gradient and every step's loss within ``tolerance``; returns (max relative gradient
    difference, max relative loss difference) for the parity table."""
    per_param = relative_gradient_differences(grads, reference_grads)
    worst_name = max(per_param, key=per_param.get)
    worst = per_param[worst_name]
    loss = max_relative_loss_difference(losses, reference_losses)
    assert worst <= tolerance.grad, f"{name}: gradient of {worst_name} off by {worst:.3g} relative (> {tolerance.grad})"
    assert loss <= tolerance.loss, f"{name}: loss off by {loss:.3g} relative (> {tolerance.loss}): {losses}"
    return worst, loss


def run_parity_cells(cells: list[dict], *, world_size: int, out_dir: Path) -> dict[str, dict]:
    """One torchrun launch of the parity worker over ``cells`` (each ``{"name", "recipe", "overrides", ...}``, run in
    sequence); returns each cell's result by name with its gradient snapshot under ``"grads"``. Fails with the
    tracebacks of the cells that failed and the launch's output tail."""
    spec = out_dir / "cells_spec.json"
    spec.write_text(json.dumps(cells))
    proc = run_script(PARITY_WORKER, nproc=world_size, args=[str(out_dir), str(spec)], timeout=1200)
    results = {c["name"]: c for c in json.loads((out_dir / "cells.json").read_text())} if proc.returncode == 0 else {}
    assert proc.returncode == 0 and all(c["ok"] for c in results.values()), (
        [c.get("traceback") for c in results.values() if not c["ok"]],
        (proc.stdout + proc.stderr)[-6000:],
    )
    for name, cell in results.items():
        cell["grads"] = torch.load(out_dir / f"{name}.pt")
    return results
