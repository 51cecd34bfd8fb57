"""Expert and context parallel train exactly like one process: the loss of 3 steps and the grad norm of every step
match a world-size-1 run of the same model, seed and data within 1e-5 relative (fp32, CPU, gloo).

Every run packs variable-length documents into rows whose length changes every step (``data.fixed_length=false``;
with seed 2 the steps are 60, 72, 96, 60, 96, 84 tokens long: divisible by 2*cp, never a model dimension), so each
cell is also a packed variable-length run. ``micro_batch_size * dp`` is 4 everywhere, so every micro step covers
the same global rows and one world-size-1 reference serves all cells. Each cell is one real ``torchrun`` launch of
the trainer; the compile cell uses a worker that runs the same production path and counts Dynamo compiles per thread.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import ROOT, assert_close_rel, run_recipe, run_script

pytestmark = pytest.mark.functional

RECIPE = "tiny/qwen3_moe_tiny.yaml"
DATA = ["data.fixed_length=false", "data.seq_len=96", "data.pad_multiple=12"]
# Seed 2: the first two steps differ in length, so automatic dynamic shapes settle by step 2 (see the compile cell).
COMMON = ["train.seed=2", "train.global_batch_size=8", "activation_checkpointing.mode=none", *DATA]
REL = 1e-5
COMPILE_WORKER = ROOT / "tests" / "functional" / "workers" / "ep_cp_compile.py"
# name -> (ranks, overrides). EP borrows its ranks from dp_shard x cp: with cp=2 on 2 ranks, ep=2 spans the CP pair.
CELLS = {
    "ep2": (2, ["parallel.ep=2", "train.micro_batch_size=2"]),
    "cp2_ulysses": (2, ["parallel.cp=2", "parallel.cp_type=ulysses", "train.micro_batch_size=4"]),
    "cp2_ring_packed_varlen": (2, ["parallel.cp=2", "parallel.cp_type=ring", "train.micro_batch_size=4"]),
    "ep2_x_cp2_ring_4ranks": (
        4,
        ["parallel.dp_shard=2", "parallel.cp=2", "parallel.cp_type=ring", "parallel.ep=2", "train.micro_batch_size=2"],
    ),
    # Selective AC with the layout that exposes the SAC desync: experts and an fp32 router as nested FSDP units,
    # explicit prefetch, an EP all-to-all and the ring's all-to-alls inside the checkpointed block.
    "selective_ac_ep2_cp2_ring": (
        2,
        [
            "parallel.cp=2",
            "parallel.cp_type=ring",
            "parallel.ep=2",
            "train.micro_batch_size=4",
            "activation_checkpointing.mode=selective",
            "model.moe.router_dtype=float32",
            "parallel.fsdp.forward_prefetch=explicit",
            "parallel.fsdp.backward_prefetch=explicit",
        ],
    ),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = run_recipe(
        RECIPE,
        nproc=1,
        run_dir=tmp_path_factory.mktemp("ws1"),
        overrides=[*COMMON, "train.steps=3", "train.micro_batch_size=4"],
    ).check()
    assert len(run.metrics) == 3
    return run.losses, [m["grad_norm"] for m in run.metrics]


@pytest.mark.parametrize("name", list(CELLS))
def test_parallel_layout_matches_one_process(name: str, reference, tmp_path) -> None:
    nproc, overrides = CELLS[name]
    run = run_recipe(RECIPE, nproc=nproc, run_dir=tmp_path / name, overrides=[*COMMON, "train.steps=3", *overrides])
    run.check()
    losses, grad_norms = reference
    assert_close_rel(run.losses, losses, rel=REL)
    assert_close_rel([m["grad_norm"] for m in run.metrics], grad_norms, rel=REL)


def test_compiled_ring_ep_matches_and_never_recompiles_after_step_2(reference, tmp_path) -> None:
    """compile ac_outer (AC(compile(block))) with ring CP over packed variable-length rows and EP, backward on its
    own thread (the CUDA autograd-thread situation): the first 3 steps match one process, and over 6 steps no thread
    compiles anything after step 2. The ring's per-micro-batch ints are dynamic from the first compile (compile's
    dynamic sources); the row length changes between steps 1 and 2, which makes the sequence dims dynamic there."""
    out = tmp_path / "compile.json"
    overrides = [
        *COMMON,
        "train.steps=6",
        "train.micro_batch_size=4",
        "train.backward_on_thread=true",
        "parallel.cp=2",
        "parallel.cp_type=ring",
        "parallel.ep=2",
        "activation_checkpointing.mode=full",
        "compile.enabled=true",
        "compile.layout=ac_outer",
    ]
    proc = run_script(COMPILE_WORKER, nproc=2, args=[str(out), *overrides], timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads(out.read_text())
    losses, grad_norms = reference
    assert_close_rel(result["losses"][:3], losses, rel=REL)
    assert_close_rel(result["grad_norms"][:3], grad_norms, rel=REL)
    compiles = result["compiles"]
    assert len(compiles) == 6
    assert compiles[0].get("MainThread:DYNAMO", 0) > 0, compiles  # compile really ran
    assert compiles[-1] == compiles[1], f"new compiles after step 2 (cumulative per thread, per step): {compiles}"


def test_compiled_ring_with_selective_ac_matches_one_process(reference, tmp_path) -> None:
    """Selective AC and compile (ac_outer) together, ring CP. Guards the SAC x inductor fix: without
    ``wrap_inductor_compiled_regions`` the policy cached references to a functional all-to-all's output inside
    inductor code, inductor reused the buffer, and the grad norm came out 3.5% off with no error."""
    overrides = [
        *COMMON,
        "train.steps=3",
        "train.micro_batch_size=4",
        "parallel.cp=2",
        "parallel.cp_type=ring",
        "activation_checkpointing.mode=selective",
        "compile.enabled=true",
        "compile.layout=ac_outer",
    ]
    run = run_recipe(RECIPE, nproc=2, run_dir=tmp_path / "sac_compile", overrides=overrides)
    run.check()
    losses, grad_norms = reference
    assert_close_rel(run.losses, losses, rel=REL)
    assert_close_rel([m["grad_norm"] for m in run.metrics], grad_norms, rel=REL)
