"""The training loop: gradient accumulation over micro batches, clipping, AdamW, metrics.

The model arrives parallelized and materialized; batches arrive per step from the data pipeline and are
prepared for this rank (context-parallel sharding, attention metadata) by ``prepare_batch``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from nemo_ac.data.batch import IGNORE_INDEX, PackedBatch
from nemo_ac.distributed.fsdp import set_gradient_sync
from nemo_ac.trainer.loss import compute_loss
from nemo_ac.trainer.metrics import MetricsLogger, StepMetrics, peak_memory_gib
from nemo_ac.trainer.optim import clip_grad_norm_
from nemo_ac.trainer.stop import maybe_signal_self


@dataclass
class PreparedBatch:
    """Model keyword inputs and labels for this rank (already sharded for context parallel).

    embed: vision-language batches under context parallel. ``embed(model)`` runs the model's full-sequence
    embedding (vision tower + token table) and returns this rank's shard of the decoder inputs, merged into
    ``model_inputs`` by ``inputs_for``. It is deferred to the micro batch's own forward so that only one micro
    batch's vision activations are alive at a time and FSDP sees embed, forward and backward in order.
    """

    model_inputs: dict[str, Any]
    labels: torch.Tensor
    embed: Callable[[nn.Module], dict[str, Any]] | None = None

    def inputs_for(self, model: nn.Module) -> dict[str, Any]:
        """Keyword inputs of ``model``'s forward for this micro batch (runs ``embed`` when there is one)."""
        return self.model_inputs if self.embed is None else {**self.model_inputs, **self.embed(model)}


class StepBatches(Protocol):
    def batches_for_step(self, step: int) -> list[PackedBatch]: ...


StepCallback = Callable[[int, dict[str, Any]], None]


@dataclass
class StepSums:
    """What ``Trainer.accumulate`` returns: device tensors, read on the host only after the update."""

    ce: torch.Tensor  # sum of this rank's token cross entropies (float64)
    aux: torch.Tensor  # this rank's load-balancing loss shares (float64)
    expert_load: torch.Tensor | None  # [MoE layers, experts] global counts summed over micro batches


def count_tokens(prepared: Sequence[PreparedBatch]) -> tuple[int, int]:
    """(label tokens, positions) of this rank's micro batches: one host sync, before any forward."""
    labels = sum(int((b.labels != IGNORE_INDEX).sum()) for b in prepared)
    return labels, sum(int(b.labels.numel()) for b in prepared)


@dataclass
class LoopOptions:
    steps: int
    grad_clip: float
    aux_loss_coef: float
    backward_on_thread: bool = False
    fail_after_step: int = 0
    # parallel.fsdp.reduce_grads == "last_micro_batch": no gradient collective until the step's last micro batch.
    reduce_grads_on_last_micro_batch_only: bool = False
    # train.loss_chunk_tokens: > 0 passes the labels to the model, which returns the cross entropy computed over
    # chunks of this many tokens (no [tokens, vocab] logits); 0 computes the loss from the whole logits here.
    loss_chunk_tokens: int = 0
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

    def global_tokens(self, prepared: Sequence[PreparedBatch]) -> int:
        """The label tokens of these prepared micro batches summed over the loss group: the divisor ``accumulate``
        takes, for callers that step by hand (``simulate.measure``)."""
        return int(self._all_reduce([count_tokens(prepared)[0]])[0])

    def train_step(self) -> StepMetrics:
        """One optimizer step over this rank's micro batches of the next global batch."""
        step = self.step + 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        prepared = [self.prepare_batch(batch.to(self.device)) for batch in self._next_micro_batches()]
        local_tokens, local_positions = count_tokens(prepared)
        global_tokens, global_positions = (int(v) for v in self._all_reduce([local_tokens, local_positions]))
        sums = self.accumulate(prepared, global_tokens=global_tokens)
        grad_norm, lr = self.update()
        self.step = step
        info: dict[str, Any] = {"expert_load": sums.expert_load}
        for callback in self.options.post_step_callbacks:
            callback(step, info)

        ce_global, aux_global = self._all_reduce([float(sums.ce), float(sums.aux)])
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

    def accumulate(
        self,
        prepared: Sequence[PreparedBatch],
        *,
        global_tokens: int,
        after_micro_batch: Callable[[int], None] | None = None,
    ) -> StepSums:
        """Forward and backward of every micro batch (gradients accumulate), without a host sync: the device work
        of a step before its optimizer update. ``global_tokens``: label tokens of the whole global batch (the loss
        divisor). ``after_micro_batch(index)`` runs after each backward (the dry run resets per-pass trackers)."""
        ce_total = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_total = torch.zeros((), dtype=torch.float64, device=self.device)
        expert_load = None
        for index, batch in enumerate(prepared):
            if self.options.reduce_grads_on_last_micro_batch_only:
                set_gradient_sync(self.model, index == len(prepared) - 1)
            output = self.model(**batch.inputs_for(self.model), **self._loss_inputs(batch))
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
            if after_micro_batch is not None:
                after_micro_batch(index)
        return StepSums(ce=ce_total, aux=aux_total, expert_load=expert_load)

    def _loss_inputs(self, batch: PreparedBatch) -> dict[str, Any]:
        """Extra forward inputs: with ``loss_chunk_tokens`` the model computes the cross entropy itself, in token
        chunks, inside its forward (where FSDP2 has the LM head's weight gathered)."""
        chunk = self.options.loss_chunk_tokens
        return {"labels": batch.labels, "loss_chunk_tokens": chunk} if chunk > 0 else {}

    def update(self) -> tuple[torch.Tensor, float]:
        """Clip, optimizer and scheduler step, zero the gradients; returns (grad norm tensor, the LR used)."""
        grad_norm = clip_grad_norm_(self.params, self.options.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr

    def _next_micro_batches(self) -> list[PackedBatch]:
        """This rank's micro batches of step ``self.step + 1``.

        A data source with a position (an iterator such as ``SyntheticBatches``, whose ``state_dict`` a checkpoint
        stores) is advanced here, so its position always equals the completed-step counter; a mismatch means the
        two were restored from different checkpoints and would silently train on other data.
        """
        if isinstance(self.data, Iterator):
            position = getattr(self.data, "next_step", self.step)
            if position != self.step:
                raise RuntimeError(f"data position next_step={position} != completed steps {self.step}")
            return next(self.data)
        return self.data.batches_for_step(self.step)

    def fit(
        self,
        *,
        on_step_end: Callable[[int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_step_start: Callable[[int], None] | None = None,
    ) -> list[StepMetrics]:
        """Train from ``self.step`` (0, or the step a checkpoint restored) to ``options.steps``.

        ``should_stop`` is asked before each step (``StopSignal.agreed``: the same answer on every rank); True ends
        the loop after the step already finished. ``on_step_start(step)`` is told each step about to run (the stop
        deadline's line names it)."""
        while self.step < self.options.steps:
            if should_stop is not None and should_stop():
                break
            if on_step_start is not None:
                on_step_start(self.step + 1)
            metrics = self.train_step()
            self.logger.log(metrics)
            if on_step_end is not None:
                on_step_end(self.step)
            if self.options.fail_after_step and self.step == self.options.fail_after_step:
                inject_failure(self.step)
            maybe_signal_self(self.step)
        return self.logger.history


def inject_failure(step: int) -> None:
    """``train.fail_after_step``: fault injection for the resume tests, after that step's checkpoint.

    Under torchrun (``TORCHELASTIC_RESTART_COUNT`` is set) only the first attempt fails, and it fails the way a
    lost node does: the last rank SIGKILLs itself (no exception handler, no cleanup) while its peers carry on into
    the next collective, which fails; the elastic agent tears the group down and, with ``--max-restarts``, starts
    a new attempt that resumes from the checkpoint and must not fail again. Without torchrun every rank raises.
    """
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restarts is None:
        raise RuntimeError(f"train.fail_after_step={step}: injected failure for fault-tolerance tests")
    if int(restarts) > 0:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == world - 1:
        print(f"train.fail_after_step={step}: rank {rank} kills itself (SIGKILL, first attempt only)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
