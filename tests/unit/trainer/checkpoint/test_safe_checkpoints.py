"""Issue 19 item 1: checkpoint.dir under the run directory, metrics.jsonl never truncated, LR schedule changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_ac.config import load_recipe, to_dict, validate_recipe
from nemo_ac.trainer.build import build_trainer, build_training, quiet_logger
from nemo_ac.trainer.checkpoint.dcp import Checkpointer, CheckpointWarning, TrainingState
from nemo_ac.trainer.metrics import MetricsLogger, StepMetrics, step_records
from nemo_ac.trainer.optim import builtin_lr

ROOT = Path(__file__).resolve().parents[4]
TINY = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"
FLAGSHIPS = sorted((ROOT / "recipes").glob("*.yaml"))
CPU = torch.device("cpu")


def test_checkpoint_dir_defaults_under_the_run_dir_and_an_explicit_one_is_kept(tmp_path):
    assert load_recipe(TINY).checkpoint.dir == "runs/qwen3_moe_tiny/checkpoints"
    assert load_recipe(TINY, [f"logging.run_dir={tmp_path}"]).checkpoint.dir == str(tmp_path / "checkpoints")
    assert load_recipe(TINY, ["checkpoint.dir="]).checkpoint.dir == "runs/qwen3_moe_tiny/checkpoints"
    assert load_recipe(TINY, ["checkpoint.dir=elsewhere/ckpt"]).checkpoint.dir == "elsewhere/ckpt"


@pytest.mark.parametrize("recipe", FLAGSHIPS, ids=lambda p: p.stem)
def test_flagship_recipes_checkpoint_by_default_into_their_run_dir(recipe):
    loaded = load_recipe(recipe)
    assert loaded.checkpoint.enabled and loaded.checkpoint.resume == "auto"
    assert loaded.checkpoint.dir == str(Path(loaded.logging.run_dir) / "checkpoints")


def _metrics(step: int, loss: float) -> StepMetrics:
    return StepMetrics(step, loss, 0.0, 1.0, 1e-3, 8, 0.1, 80.0, 0.0)


def _logger(run_dir: Path, resumed_from_step: int = 0) -> MetricsLogger:
    return MetricsLogger(
        run_dir=str(run_dir),
        total_steps=4,
        enabled=True,
        jsonl=True,
        progress_bar="never",
        log_every=1,
        resumed_from_step=resumed_from_step,
    )


def test_a_fresh_start_appends_to_metrics_jsonl_after_a_start_marker(tmp_path):
    first = _logger(tmp_path)
    for step in (1, 2, 3, 4):
        first.log(_metrics(step, 10.0 - step))
    second = _logger(tmp_path)  # resume: auto with nothing to resume, or resume: none, in the same run_dir
    second.log(_metrics(1, 5.0))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("step", r.get("event")) for r in lines] == ["start", 1, 2, 3, 4, "start", 1]
    assert [(r["step"], r["loss"]) for r in step_records(tmp_path / "metrics.jsonl")] == [(1, 5.0)]
    # A resume of the second run from step 1 drops only that run's later records, never the first run's.
    second.log(_metrics(2, 4.0))
    third = _logger(tmp_path, resumed_from_step=1)
    third.log(_metrics(2, 4.5))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("step", r.get("event")) for r in lines] == ["start", 1, 2, 3, 4, "start", 1, "start", 2]
    assert [(r["step"], r["loss"]) for r in step_records(tmp_path / "metrics.jsonl")] == [(1, 5.0), (2, 4.5)]


def _build(ckpt: Path, *overrides: str):
    recipe = load_recipe(
        TINY,
        ["data.seq_len=40", "train.global_batch_size=2", "train.micro_batch_size=2", "train.steps=4"]
        + [f"checkpoint.dir={ckpt}", "checkpoint.enabled=true", "checkpoint.resume=auto", *overrides],
    )
    setup = build_training(recipe, validate_recipe(recipe, world_size=1), device=CPU)
    trainer = build_trainer(setup, logger=quiet_logger(recipe))
    checkpointer = Checkpointer(
        config=recipe.checkpoint, total_steps=recipe.train.steps, recipe=to_dict(recipe), device=CPU
    )
    state = TrainingState(model=setup.model, optimizer=setup.optimizer, scheduler=setup.scheduler, data=setup.data)
    return recipe, trainer, checkpointer, state


@pytest.mark.usefixtures("world")
def test_resume_with_a_changed_schedule_warns_with_both_values_and_follows_the_new_one(tmp_path, recwarn):
    _, trainer, checkpointer, state = _build(tmp_path)
    trainer.train_step()
    trainer.train_step()
    checkpointer.save(2, state)

    recipe, trainer, checkpointer, state = _build(tmp_path)  # same schedule: silent, LR as saved
    assert checkpointer.restore(state) == 2
    assert not [w for w in recwarn if issubclass(w.category, CheckpointWarning)]
    same = state.optimizer.param_groups[0]["lr"]
    assert same == pytest.approx(builtin_lr(2, to_dict(recipe)["train"]), rel=1e-12)

    recipe, trainer, checkpointer, state = _build(tmp_path, "train.steps=8", "train.lr=1e-3")
    with pytest.warns(CheckpointWarning, match=r"train\.steps: checkpoint 4, recipe 8; train\.lr: checkpoint 0\.00"):
        trainer.step = checkpointer.restore(state)
    new = builtin_lr(2, to_dict(recipe)["train"])
    assert [g["lr"] for g in state.optimizer.param_groups] == [new] * len(state.optimizer.param_groups)
    assert trainer.train_step().lr == new
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(builtin_lr(3, to_dict(recipe)["train"]), rel=1e-12)
