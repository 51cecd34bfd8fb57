"""The training loop: gradient accumulation over micro batches, clipping, AdamW, metrics.

The model arrives parallelized and materialized; batches arrive per step from the data pipeline and are
prepared for this rank (context-parallel sharding, attention metadata) by ``prepare_batch``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from nemo_ac.data.batch import IGNORE_INDEX, PackedBatch
from nemo_ac.trainer.loss import compute_loss
from nemo_ac.trainer.metrics import MetricsLogger, StepMetrics, peak_memory_gib
from nemo_ac.trainer.optim import clip_grad_norm_


@dataclass
class PreparedBatch:
    """Model keyword inputs and labels for this rank (already sharded for context parallel)."""

    model_inputs: dict[str, Any]
    labels: torch.Tensor


class StepBatches(Protocol):
    def batches_for_step(self, step: int) -> list[PackedBatch]: ...


StepCallback = Callable[[int, dict[str, Any]], None]


@dataclass
class LoopOptions:
    steps: int
    grad_clip: float
    aux_loss_coef: float
    backward_on_thread: bool = False
    fail_after_step: int = 0
    # Called after each optimizer step with (step, info); info has "expert_load" ([L, E] global counts) when MoE.
    post_step_callbacks: list[StepCallback] = field(default_factory=list)
    # Extra per-step metric sources (e.g. compile counters): name -> callable returning a JSON-able value.
    metric_sources: dict[str, Callable[[], Any]] = field(default_factory=dict)


def run_backward(loss: torch.Tensor, *, on_thread: bool) -> None:
    """loss.backward(), optionally on a worker thread.

    On CUDA, autograd runs backward on its device thread, whose Dynamo config is the per-thread default since
    torch 2.12. On CPU backward runs on the calling thread, so ``train.backward_on_thread`` emulates the GPU
    situation for tests.
    """
    if not on_thread:
        loss.backward()
        return
    errors: list[BaseException] = []

    def work() -> None:
        try:
            loss.backward()
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=work, name="nemo_ac-backward")
    worker.start()
    worker.join()
    if errors:
        raise errors[0]


class Trainer:
    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        data: StepBatches,
        prepare_batch: Callable[[PackedBatch], PreparedBatch],
        device: torch.device,
        logger: MetricsLogger,
        options: LoopOptions,
        loss_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.prepare_batch = prepare_batch
        self.device = device
        self.logger = logger
        self.options = options
        self.loss_group = loss_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.step = 0  # completed optimizer steps

    def _all_reduce(self, values: Sequence[float]) -> list[float]:
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size(self.loss_group) > 1:
            dist.all_reduce(tensor, group=self.loss_group)
        return tensor.tolist()

    def train_step(self) -> StepMetrics:
        """One optimizer step over this rank's micro batches of the next global batch."""
        step = self.step + 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        prepared = [self.prepare_batch(batch.to(self.device)) for batch in self.data.batches_for_step(self.step)]
        local_tokens = sum(int((b.labels != IGNORE_INDEX).sum()) for b in prepared)
        local_positions = sum(int(b.labels.numel()) for b in prepared)
        global_tokens, global_positions = (int(v) for v in self._all_reduce([local_tokens, local_positions]))

        ce_total = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_total = torch.zeros((), dtype=torch.float64, device=self.device)
        expert_load = None
        for batch in prepared:
            output = self.model(**batch.model_inputs)
            parts = compute_loss(
                output,
                batch.labels,
                num_global_label_tokens=global_tokens,
                num_micro_batches=len(prepared),
                aux_loss_coef=self.options.aux_loss_coef,
                group=self.loss_group,
            )
            run_backward(parts.loss, on_thread=self.options.backward_on_thread)
            ce_total += parts.ce_sum.double()
            aux_total += parts.aux.double()
            if parts.expert_load is not None:
                expert_load = parts.expert_load if expert_load is None else expert_load + parts.expert_load

        grad_norm = clip_grad_norm_(self.params, self.options.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        info: dict[str, Any] = {"expert_load": expert_load}
        for callback in self.options.post_step_callbacks:
            callback(step, info)

        ce_global, aux_global = self._all_reduce([float(ce_total), float(aux_total)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - started
        extra = {name: source() for name, source in self.options.metric_sources.items()}
        return StepMetrics(
            step=step,
            loss=ce_global / max(global_tokens, 1),
            aux_loss=aux_global,
            grad_norm=float(grad_norm),
            lr=lr,
            tokens=global_positions,
            step_time_s=elapsed,
            tokens_per_s=global_positions / max(elapsed, 1e-9),
            peak_memory_gib=peak_memory_gib(self.device),
            extra=extra,
        )

    def fit(self, *, on_step_end: Callable[[int], None] | None = None) -> list[StepMetrics]:
        while self.step < self.options.steps:
            metrics = self.train_step()
            self.logger.log(metrics)
            if on_step_end is not None:
                on_step_end(self.step)
            if self.options.fail_after_step and self.step == self.options.fail_after_step:
                raise RuntimeError(f"train.fail_after_step={self.step}: injected failure for fault-tolerance tests")
        return self.logger.history
