"""Rank 0's terminal output: the tqdm bar at a given width with lines printed through it, plain lines off a TTY,
and the compile progress lines of a real torch.compile."""

from __future__ import annotations

import io
import re
import sys
import warnings

import torch

from nemo_ac.diagnostics.compile_progress import CompileProgress
from nemo_ac.trainer.metrics import MetricsLogger, StepMetrics, Throughput
from nemo_ac.trainer.progress import Progress, echo, format_duration, use_bar


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(step, 4.0 - step / 10, 0.01, 1.25, 3e-4, 4096, 0.5, 8192.0, 1.5)


def _screen(raw: str) -> list[str]:
    """What a terminal shows of ``raw``: each ``\\r`` returns to the line start, so only the last redraw remains."""
    lines = []
    for line in raw.split("\n"):
        last = line.split("\r")[-1]
        lines.append(re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", last))
    return [line for line in lines if line.strip()]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_uses_the_bar_only_on_a_terminal():
    assert use_bar("auto", FakeTTY()) and not use_bar("auto", io.StringIO())
    assert use_bar("always", io.StringIO()) and not use_bar("never", FakeTTY())


def test_the_bar_fits_the_width_and_a_line_printed_mid_run_stays_whole(monkeypatch):
    for columns in (80, 200):
        stream, errors = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stderr", errors)
        progress = Progress(total_steps=10, initial_step=0, bar=True, log_every=1, stream=stream, columns=columns)
        for step in range(1, 11):
            metrics = _metrics(step)
            progress.update(step, short=metrics.short(), full=metrics.line(10))
            if step == 5:
                echo("checkpoint | saved /tmp/run/step_5 (1.3 MiB, 0.09 s)")
                with warnings.catch_warnings():
                    warnings.simplefilter("always")  # not once per location: both widths must show it
                    warnings.warn("a warning mid-run", RuntimeWarning, stacklevel=1)
        progress.close()
        assert warnings.showwarning is not progress._warning  # restored
        screen = _screen(stream.getvalue())
        assert any(line.endswith("RuntimeWarning: a warning mid-run") for line in _screen(errors.getvalue()))
        assert "checkpoint | saved /tmp/run/step_5 (1.3 MiB, 0.09 s)" in screen, screen
        bars = [line for line in screen if line.startswith("step ")]
        assert bars and all(len(line) <= columns for line in bars), (columns, bars)
        final = bars[-1]
        assert final.startswith("step 10/10 |") and "loss 3.0000" in final and "8,192 tok/s" in final
        bar = final.split("|")[1]
        assert len(bar) >= 10  # metrics beyond the first that would squeeze the bar are dropped
        assert ("1.50 GiB" in final) == (columns == 200), final  # the tail only where it fits


def test_plain_lines_every_log_every_steps_with_elapsed_and_eta():
    stream = io.StringIO()
    progress = Progress(total_steps=5, initial_step=0, bar=False, log_every=2, stream=stream)
    for step in range(1, 6):
        metrics = _metrics(step)
        progress.update(step, short=metrics.short(), full=metrics.line(5))
    lines = stream.getvalue().splitlines()
    assert [line.split("|")[0].split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
    assert all("\r" not in line and "elapsed 0:00" in line for line in lines)
    assert "eta" in lines[0] and "eta" not in lines[-1]
    assert format_duration(75.2) == "1:15" and format_duration(3725) == "1:02:05"


def test_every_record_gets_time_tokens_per_rank_and_mfu(tmp_path):
    import json

    throughput = Throughput(world_size=4, flops_per_token=1e6, peak_flops=1e10, peak_source="measured test")
    stream = io.StringIO()
    logger = MetricsLogger(
        run_dir=str(tmp_path),
        total_steps=2,
        enabled=True,
        jsonl=True,
        progress_bar="never",
        log_every=1,
        stream=stream,
        throughput=throughput,
    )
    for step in (1, 2):
        logger.log(_metrics(step))
    summary = logger.summary()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["time"] > 1.7e9 and record["time_iso"].endswith("+00:00")
        assert record["tokens_per_s_per_rank"] == 8192.0 / 4
        assert record["mfu"] == 1e6 * 2048.0 / 1e10
        assert record["loss"] == _metrics(record["step"]).loss  # the old fields, unchanged
    assert summary["median_mfu"] == steps[1]["mfu"] and summary["mfu_peak"] == "measured test"
    assert "mfu 20.48%" in stream.getvalue()

    unknown = MetricsLogger(
        run_dir=str(tmp_path / "b"), total_steps=1, enabled=True, jsonl=True, progress_bar="never", log_every=1
    )
    unknown.log(_metrics(1))
    (record,) = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[1:]]
    assert "mfu" not in record and record["tokens_per_s_per_rank"] == 8192.0  # no peak known: no mfu field


def test_compile_progress_prints_a_line_per_forward_and_backward_graph(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    lines: list[str] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).cos().sum()

    compiled = torch.compile(f, backend="aot_eager")
    with CompileProgress(lines.append, heartbeat_s=0) as progress:
        compiled(torch.randn(8, requires_grad=True)).backward()
        compiled(torch.randn(8, requires_grad=True)).backward()  # cached: no new line
    torch._dynamo.reset()
    assert progress.graphs == 2 and len(lines) == 2, lines
    assert re.fullmatch(
        r"compile \| fwd graph \[0/0\] done in [0-9.]+ s \(1 graph so far, [0-9.]+ s since start\)", lines[0]
    )
    assert lines[1].startswith("compile | bwd graph of [0/0] done in ") and "(2 graphs so far" in lines[1]
