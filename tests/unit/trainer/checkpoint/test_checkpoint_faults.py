"""Resume bookkeeping around the checkpoint: fault injection fails only the first torchrun attempt, the metrics
file of a resumed run tells the whole curve once, and the loop refuses data whose position disagrees with its step.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from nemo_ac.trainer.loop import LoopOptions, Trainer, inject_failure
from nemo_ac.trainer.metrics import MetricsLogger, StepMetrics, step_records
from nemo_ac.workarounds.rendezvous_shared_store import elastic_restart_hazard


def metrics(step: int, loss: float) -> StepMetrics:
    return StepMetrics(
        step=step,
        loss=loss,
        aux_loss=0.0,
        grad_norm=0.0,
        lr=0.0,
        tokens=1,
        step_time_s=0.1,
        tokens_per_s=10.0,
        peak_memory_gib=0.0,
    )


def test_injected_failure_raises_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(RuntimeError, match=r"train.fail_after_step=4: injected failure"):
        inject_failure(4)


def test_injected_failure_spares_restarted_attempts(monkeypatch):
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    inject_failure(4)
    assert kills == []


def test_first_torchrun_attempt_sigkills_the_last_rank(monkeypatch):
    """World of one outside a process group: rank 0 is the last rank, so it is the one that dies."""
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    inject_failure(4)
    assert kills == [(os.getpid(), signal.SIGKILL)]


def test_resumed_metrics_keep_earlier_steps_and_drop_the_ones_trained_again(tmp_path):
    first = MetricsLogger(
        run_dir=str(tmp_path), total_steps=6, enabled=True, jsonl=True, progress_bar="never", log_every=1
    )
    for step in range(1, 6):
        first.log(metrics(step, 10.0 - step))
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 6, "lo')  # the line the crash cut short
    resumed = MetricsLogger(
        run_dir=str(tmp_path),
        total_steps=6,
        enabled=True,
        jsonl=True,
        progress_bar="never",
        log_every=1,
        resumed_from_step=4,
    )
    resumed.log(metrics(5, 4.5))
    resumed.log(metrics(6, 4.0))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], r["loss"]) for r in records if "event" not in r]
    assert steps == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 4.5), (6, 4.0)]
    assert [r["resumed_from_step"] for r in records if r.get("event") == "start"] == [0, 4]
    fresh = MetricsLogger(
        run_dir=str(tmp_path), total_steps=6, enabled=True, jsonl=True, progress_bar="never", log_every=1
    )
    assert step_records(fresh.jsonl_path) == []  # a run that did not resume starts a new curve ...
    assert len(fresh.jsonl_path.read_text().splitlines()) == len(records) + 1  # ... after the earlier ones


class _Position:
    """A data source with a position, like SyntheticBatches."""

    def __init__(self, next_step: int) -> None:
        self.next_step = next_step

    def __iter__(self):
        return self

    def __next__(self):
        self.next_step += 1
        return []


def test_loop_refuses_data_at_another_position_than_its_step():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        data=_Position(next_step=3),
        prepare_batch=lambda batch: batch,
        device=torch.device("cpu"),
        logger=MetricsLogger(run_dir="", total_steps=5, enabled=False, jsonl=False, progress_bar="never", log_every=1),
        options=LoopOptions(steps=5, grad_clip=0.0, aux_loss_coef=0.0),
    )
    trainer.step = 2
    with pytest.raises(RuntimeError, match=r"data position next_step=3 != completed steps 2"):
        trainer.train_step()
    trainer.step = 3
    assert trainer._next_micro_batches() == [] and trainer.data.next_step == 4


@pytest.mark.parametrize(
    ("max_restarts", "agent_store", "warned"),
    [("2", "True", True), ("2", "False", False), ("0", "True", False), (None, None, False)],
    ids=["restarts_shared_store", "restarts_fresh_store", "no_restarts", "not_torchrun"],
)
def test_restart_hazard_only_with_restarts_on_the_shared_store(monkeypatch, max_restarts, agent_store, warned):
    for name, value in (("TORCHELASTIC_MAX_RESTARTS", max_restarts), ("TORCHELASTIC_USE_AGENT_STORE", agent_store)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    hazard = elastic_restart_hazard()
    assert (hazard is not None) == warned
    if warned:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in hazard
