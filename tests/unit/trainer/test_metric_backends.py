"""TensorBoard event files read back with tensorboard's own reader; a W&B offline run directory; a recipe asking
for a backend whose package is missing fails validation with the key and the pip line."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from nemo_ac.config import ConfigError, check_environment, load_recipe
from nemo_ac.config.schema import LoggingConfig, WandbConfig
from nemo_ac.trainer.metric_backends import build_backends, scalars
from nemo_ac.trainer.metrics import MetricsLogger, StepMetrics, Throughput
from tests.launch import RECIPES

STEPS = 4


def _train_logger(config: LoggingConfig) -> MetricsLogger:
    logger = MetricsLogger(
        run_dir=config.run_dir,
        total_steps=STEPS,
        enabled=True,
        jsonl=True,
        progress_bar="never",
        log_every=1,
        throughput=Throughput(world_size=2, flops_per_token=1e5, peak_flops=1e11, peak_source="measured"),
        backends=build_backends(config, run_name="tiny", recipe={"train": {"steps": STEPS}}, resumed_from_step=0),
    )
    for step in range(1, STEPS + 1):
        logger.log(
            StepMetrics(step, 5.0 - step * 0.25, 0.01, 1.0 + step, 1e-3, 512, 0.1, 5120.0, 0.2, {"compiles_fwd": 3})
        )
    logger.summary({"resumed_from_step": 0})
    return logger


def test_scalars_are_the_numeric_fields_without_step_and_time():
    record = {"step": 3, "time": 1.8e9, "time_iso": "x", "loss": 2.5, "tokens": 512, "flag": True, "why": "text"}
    assert scalars(record) == {"loss": 2.5, "tokens": 512.0}


def test_tensorboard_event_files_hold_every_jsonl_scalar(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra (in dev) reads the event files back")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = LoggingConfig(run_dir=str(tmp_path), tensorboard=True)
    _train_logger(config)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"event"' not in x]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/tokens_per_s_per_rank", "train/mfu", "train/compiles_fwd"} <= tags
    assert tags == {f"train/{key}" for key in scalars(records[0])}
    for key in ("loss", "grad_norm", "mfu", "tokens_per_s_per_rank"):
        got = [(e.step, e.value) for e in events.Scalars(f"train/{key}")]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records], key
    assert [e.wall_time for e in events.Scalars("train/loss")] == [pytest.approx(r["time"]) for r in records]


def test_wandb_offline_run_directory(tmp_path, monkeypatch):
    pytest.importorskip(
        "wandb", reason="optional extra nemo_ac[wandb], not in dev (~60 MB with its OpenTelemetry deps)"
    )
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = LoggingConfig(run_dir=str(tmp_path), wandb=WandbConfig(mode="offline", project="nemo_ac_test"))
    _train_logger(config)
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    (log,) = run.glob("run-*.wandb")  # the records `wandb sync` uploads (protobuf: the keys appear as text)
    deadline = time.monotonic() + 60  # wandb's service process writes the file after finish() returns
    while b"final_loss" not in (data := log.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"train/loss" in data and b"train/mfu" in data and b"final_loss" in data


def test_a_backend_without_its_package_fails_validation_with_the_key_and_the_extra(monkeypatch):
    recipe = load_recipe(
        str(RECIPES / "tiny/qwen3_moe_tiny.yaml"), ["logging.tensorboard=true", "logging.wandb.mode=offline"]
    )
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a)
    )
    issues = check_environment(recipe, cuda_available=False)
    text = str(ConfigError(issues))
    assert "logging.tensorboard: true needs the optional package 'tensorboard'" in text
    assert "pip install 'nemo_ac[tensorboard]'" in text
    assert "logging.wandb.mode: 'offline' needs the optional package 'wandb'" in text and "nemo_ac[wandb]" in text
    assert len(issues) == 2  # nothing else in the tiny recipe needs an extra
