"""``nemo-ac plan --trace`` and ``--memory-plot``: the estimated step as a Perfetto trace and a memory PNG."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from nemo_ac.cli import main as cli
from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.simulate.estimate import estimate_step
from nemo_ac.simulate.gpus import GPUS
from nemo_ac.simulate.run import SimulationOptions, simulate
from nemo_ac.simulate.trace import STREAMS, memory_series, step_timeline

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "recipes/tiny/qwen3_moe_tiny.yaml")
GLM = str(ROOT / "recipes/tiny/glm_4_5_air_tiny.yaml")


def _slices(trace: dict, stream: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == STREAMS[stream]]


@pytest.mark.parametrize(("recipe", "world"), [(TINY, 2), (GLM, 2)])
def test_each_stream_of_the_trace_adds_up_to_the_estimates_term(recipe: str, world: int) -> None:
    """Compute, FSDP, blocking collectives and the host link (GLM tiny: full optimizer offload and activation
    offload) each sum to the estimate's figure for them; the compute stream's slices never overlap."""
    loaded = load_recipe(recipe, ["dist.device=cuda", "dist.backend=nccl"])
    simulation = simulate(loaded, validate_recipe(loaded, world_size=world), SimulationOptions(world_size=world))
    gpu = GPUS["h100-80gb"]
    estimate = estimate_step(simulation.measurement.counts, gpu=gpu)
    trace, starts = step_timeline(simulation.measurement.counts, gpu=gpu)
    json.loads(json.dumps(trace))  # what Perfetto loads
    total = {name: sum(e["dur"] for e in _slices(trace, name)) / 1e6 for name in STREAMS}
    assert total["compute"] == pytest.approx(estimate.compute_s, rel=1e-9)
    assert total["FSDP all-gather / reduce-scatter"] == pytest.approx(estimate.overlapped_s, rel=1e-9)
    assert total["EP / CP / loop collectives"] == pytest.approx(estimate.exposed_s, rel=1e-9)
    host = estimate.host_overlapped_s + estimate.host_exposed_s + estimate.host_step_s
    assert total["host link"] == pytest.approx(host, rel=1e-9, abs=1e-12)
    compute = _slices(trace, "compute")
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-6 for a, b in itertools.pairwise(compute))
    assert trace["otherData"]["end_s"] >= estimate.compute_s
    assert "mm" in {e["name"] for e in compute}
    assert starts == sorted(starts)
    if recipe == GLM:
        assert host > 0 and _slices(trace, "host link")


def test_plan_writes_the_trace_and_the_memory_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace_path, plot_path = tmp_path / "step.json", tmp_path / "memory.png"
    args = ["plan", TINY, "--world-size", "2", "--gpu", "h100-80gb", "--trace", str(trace_path),
            "--memory-plot", str(plot_path)]  # fmt: skip
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "trace of the estimated step" in out and "memory plot written" in out
    trace = json.loads(trace_path.read_text())
    named = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert named == set(STREAMS)
    assert _slices(trace, "compute") and _slices(trace, "FSDP all-gather / reduce-scatter")
    from PIL import Image

    with Image.open(plot_path) as image:
        assert image.format == "PNG" and image.size[0] > 600


def test_the_memory_series_reaches_the_reported_peak() -> None:
    """The sampler keeps every new high, so the plotted series peaks at the report's tracked peak."""
    loaded = load_recipe(TINY)
    options = SimulationOptions(world_size=2, memory_timeline=True)
    simulation = simulate(loaded, validate_recipe(loaded, world_size=2), options)
    _, starts = step_timeline(simulation.measurement.counts, gpu=GPUS["h100-80gb"])
    series = memory_series(simulation.measurement.timeline, starts)
    assert len(series) > 10
    assert max(sum(groups.values()) for _, groups in series) == simulation.measurement.peak.peak_bytes
    assert [t for t, _ in series] == sorted(t for t, _ in series)


@pytest.mark.parametrize("flag", ["--trace", "--memory-plot"])
def test_a_picture_of_a_depth_scaled_plan_is_refused_before_the_dry_run(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = ["plan", TINY, "--world-size", "2", "--depth", "scaled", flag, str(tmp_path / "out")]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert flag in err and "--depth scaled" in err and len(err.strip().splitlines()) == 1
