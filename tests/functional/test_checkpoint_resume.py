"""Checkpoint, resume and faults on real torchrun launches (FSDP2 over gloo, DCP on disk).

One uninterrupted 6-step run at world size 2 is the reference for every comparison, and one run stopped by a
killed rank after step 3's checkpoint is resumed several ways (same world size, 1 and 4 ranks, corrupt).
"""

from __future__ import annotations

import shutil

import pytest

from tests.launch import RunResult, assert_close_rel, checkpointing, records, run_recipe

pytestmark = pytest.mark.functional

RECIPE = "tiny/qwen3_moe_tiny.yaml"
STEPS = 6
# The tiny recipe's micro_batch_size 2 at 2 ranks: 4 global rows per micro step, kept for every world size.
COMMON = [f"train.steps={STEPS}", "train.global_batch_size=8", "checkpoint.keep_last=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> RunResult:
    run = run_recipe(RECIPE, nproc=2, run_dir=tmp_path_factory.mktemp("reference"), overrides=COMMON).check()
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    return run


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> RunResult:
    """Rank 1 is SIGKILLed right after step 3's checkpoint (first torchrun attempt, no restarts allowed)."""
    run_dir = tmp_path_factory.mktemp("stopped")
    run = run_recipe(
        RECIPE,
        nproc=2,
        run_dir=run_dir,
        overrides=[*COMMON, *checkpointing(run_dir / "ckpt", every=3), "train.fail_after_step=3"],
    )
    assert run.returncode != 0, run.output[-3000:]
    assert "train.fail_after_step=3: rank 1 kills itself" in run.output
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == ["latest", "step_3"]
    return run


def test_resume_after_a_kill_is_bitwise_the_uninterrupted_run(tmp_path, reference, stopped):
    """6 steps straight vs 3, killed, resumed (auto), 3 more: identical per-step losses and grad norms (fp32 CPU).

    A save that a crash interrupted (shards written, no DCP metadata, no manifest) sits next to the good
    checkpoint: it is skipped with a warning. The resumed run's metrics.jsonl holds the whole curve once.
    """
    assert stopped.losses == reference.losses[:3]
    run_dir = tmp_path / "run"
    shutil.copytree(stopped.run_dir, run_dir)
    ckpt = run_dir / "ckpt"
    interrupted = ckpt / ".step_4.partial"
    interrupted.mkdir()
    for shard in (ckpt / "step_3").glob("*.distcp"):
        shutil.copy(shard, interrupted / shard.name)

    resumed = run_recipe(RECIPE, nproc=2, run_dir=run_dir, overrides=[*COMMON, *checkpointing(ckpt, every=3)]).check()
    assert f"skipping {interrupted}: a save that never finished" in resumed.output
    assert f"resumed from {ckpt / 'step_3'} at step 3" in resumed.output
    assert [m["step"] for m in resumed.metrics] == list(range(1, STEPS + 1))
    assert resumed.losses == reference.losses
    assert records(resumed, "grad_norm") == records(reference, "grad_norm")
    assert records(resumed, "lr") == records(reference, "lr")
    assert resumed.summary["resumed_from_step"] == 3
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_3", "step_6"]
    assert (ckpt / "latest").read_text().strip() == "step_6"


def test_full_optimizer_offload_steps_and_resumes_bitwise_as_on_the_device(tmp_path, reference):
    """``train.optimizer_offload=full`` (FSDP2's CPUOffloadPolicy: shards, gradients and AdamW on the host; on a
    CPU run the copies are no-ops but every code path is FSDP2's offloaded one, the gradient-norm all-reduce over
    host shards included): killed after step 3's checkpoint, resumed, and the whole curve (losses, grad norms) is
    bitwise the on-device reference's. The DCP checkpoint is the one a run without offload writes: the reference's
    step 3 resumes here too."""
    offload = ["train.optimizer_offload=full"]
    ckpt = tmp_path / "ckpt"
    stopped = run_recipe(
        RECIPE,
        nproc=2,
        run_dir=tmp_path / "stopped",
        overrides=[*COMMON, *offload, *checkpointing(ckpt, every=3), "train.fail_after_step=3"],
    )
    assert stopped.returncode != 0, stopped.output[-3000:]
    assert "sharded parameters + gradients + optimizer on host" in stopped.output
    assert stopped.losses == reference.losses[:3]
    assert records(stopped, "grad_norm") == records(reference, "grad_norm")[:3]
    resumed = run_recipe(
        RECIPE, nproc=2, run_dir=tmp_path / "resumed", overrides=[*COMMON, *offload, *checkpointing(ckpt, every=3)]
    ).check()
    assert f"resumed from {ckpt / 'step_3'} at step 3" in resumed.output
    assert [m["step"] for m in resumed.metrics][-3:] == [4, 5, 6]
    assert records(resumed, "loss")[-3:] == reference.losses[3:]
    assert records(resumed, "grad_norm")[-3:] == records(reference, "grad_norm")[3:]


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        pytest.param(1, ["train.micro_batch_size=4"], id="ws1"),
        pytest.param(4, ["train.micro_batch_size=1", "parallel.ep=2"], id="ws4_ep2", marks=pytest.mark.slow),
    ],
)
def test_reshard_from_world_size_2(tmp_path, reference, stopped, nproc, layout):
    """Saved at world size 2 (FSDP only), resumed at 1, or at 4 with experts sharded over ep=2 as well (DTensors on
    a 2-D mesh): micro_batch_size * dp is kept, so micro steps see the same rows, and the curve continues as the
    uninterrupted one within 1e-6."""
    step_3 = stopped.run_dir / "ckpt" / "step_3"
    run = run_recipe(
        RECIPE,
        nproc=nproc,
        run_dir=tmp_path / "run",
        overrides=[*COMMON, *layout, f"checkpoint.resume={step_3}"],
    ).check()
    assert f"saved at world size 2, resharded to {nproc}" in run.output
    assert [m["step"] for m in run.metrics] == [4, 5, 6]
    assert_close_rel(run.losses, reference.losses[3:], rel=1e-6)
    assert_close_rel(records(run, "grad_norm"), records(reference, "grad_norm")[3:], rel=1e-5)


def test_killed_rank_under_torchrun_restarts_resumes_and_finishes(tmp_path, reference):
    """torchrun --max-restarts 1: rank 1 is SIGKILLed after step 5 (step 4 was the last checkpoint, step 5's work
    is lost). The agent restarts the group, which resumes from step_4, trains 5 and 6, and matches the reference."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "ckpt"
    run = run_recipe(
        RECIPE,
        nproc=2,
        run_dir=run_dir,
        max_restarts=1,
        env={
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"
        },  # see nemo_ac.workarounds.rendezvous_shared_store.elastic_restart_hazard
        overrides=[*COMMON, *checkpointing(ckpt, every=2), "train.fail_after_step=5"],
    ).check()
    assert "train.fail_after_step=5: rank 1 kills itself" in run.output
    assert "nemo_ac WARNING: torchrun --max-restarts" not in run.output
    assert f"resumed from {ckpt / 'step_4'} at step 4" in run.output
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))  # step 5 once, from the second attempt
    assert run.losses == reference.losses
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_4", "step_6"]  # keep_last=2


def test_corrupt_checkpoint_fails_clearly_on_every_rank(tmp_path, stopped):
    """One flipped bit in a shard: both ranks stop with the file named (no hang, no silent fallback)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(stopped.run_dir / "ckpt", ckpt)
    shard = ckpt / "step_3" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    run = run_recipe(RECIPE, nproc=2, run_dir=tmp_path / "run", overrides=[*COMMON, *checkpointing(ckpt, every=3)])
    assert run.returncode != 0
    assert f"checkpoint {ckpt / 'step_3'} is corrupt:" in run.output
    assert f"{shard}: sha256" in run.output and "does not match the manifest" in run.output
    for rank in (0, 1):  # one line per rank (nemo_ac.train.entry); the traceback is in torchrun's summary
        line = (
            f"nemo_ac: rank {rank} failed: CheckpointError: checkpoint {ckpt / 'step_3'} is corrupt: - {shard}: sha256"
        )
        assert line in run.output, run.output[-4000:]
    assert run.metrics == []
