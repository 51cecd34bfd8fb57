"""The tiny Qwen3.6 MedPix recipe end to end (recipes/tiny/qwen3_6_medpix_tiny.yaml, what ``make run`` runs).

4 gloo ranks, EP2 x CP2 (ulysses over both layer types: one Gated DeltaNet, one gated attention layer), FSDP2 with
experts and the fp32 router as nested units, selective AC, inductor compile (AC(compile(block)) for both blocks),
a frozen one-block vision tower run on the full rows before CP sharding, packed synthetic MedPix rows (160 tokens,
two samples each, never a model dimension).

Launches (about 4 minutes cold on 2 cores, nearly all of it the compiled launch's inductor compile on 4 ranks):

- world size 1, eager, 3 steps: the reference. ``micro_batch_size * dp`` is 2 in both layouts, so every micro step
  covers the same rows; eager is the honest reference for the compiled run because inductor on CPU matches eager
  to ~1e-7 here (measured: loss 2e-8, grad norm 5e-7 relative), far inside 1e-5. It computes the whole logits
  and their cross entropy and keeps AdamW's states on the device; the recipe runs the LM head + loss in 32-token
  chunks (``train.loss_chunk_tokens``) and keeps the states in host memory (``train.optimizer_offload``), so the
  parity below holds both to the plain path under EP x CP, compile, SAC and MedPix rows.
- the recipe as is, 6 steps: parity with the reference over 3 steps (loss and grad norm, 1e-5 relative), the loss
  falls, no compile on any thread after step 2, no eager fallback.
- the recipe with only ``activation_checkpointing.workarounds=false``: the torch 2.13 field failure (nested expert
  units in a checkpointed block under EP x CP; on 4 ranks the default prefetch layout fails), explained by
  SACDesyncError. It reuses the compiled launch's inductor cache.
- a 2-rank worker (tests/functional/workers/vl_freeze_resume.py, eager): the frozen tower gets no optimizer state
  and no gradient reduction, and a run resumed from a DCP checkpoint continues on the same MedPix rows.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.launch import ROOT, assert_close_rel, run_recipe, run_script

pytestmark = pytest.mark.functional

RECIPE = "tiny/qwen3_6_medpix_tiny.yaml"
REL = 1e-5
STEPS = 6
COUNTS = ("compiles_fwd", "compiles_bwd", "recompiles_fwd", "recompiles_bwd", "bwd_graphs", "graph_breaks")
WORKER = ROOT / "tests" / "functional" / "workers" / "vl_freeze_resume.py"
FIELD_ERROR = (
    r"profiler._record_function_enter_new.default invocation index \d+ encountered during backward but not found in "
    r"storage"
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    overrides = [
        "parallel.cp=1",
        "parallel.ep=1",
        "train.micro_batch_size=2",
        "compile.enabled=false",
        "train.steps=3",
        "train.loss_chunk_tokens=0",
        "train.optimizer_offload=none",
    ]
    run = run_recipe(RECIPE, nproc=1, run_dir=tmp_path_factory.mktemp("ws1"), overrides=overrides).check()
    assert len(run.metrics) == 3
    return run


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    run = run_recipe(
        RECIPE, nproc=4, run_dir=tmp_path_factory.mktemp("ep2cp2"), overrides=[f"train.steps={STEPS}"], timeout=1500
    )
    return run.check()


@pytest.mark.slow
def test_tiny_recipe_trains_and_matches_one_process(recipe_run, reference):
    out = recipe_run.output
    assert "world 4 = dp_replicate 1 x dp_shard 2 x cp 2 (ep 2)" in out
    assert "frozen vision_tower" in out and "compile | inductor | layouts: ac_outer, ac_outer" in out
    assert len(recipe_run.metrics) == STEPS
    losses = recipe_run.losses
    assert losses[-1] < losses[0] and min(losses[3:]) < min(losses[:3]), losses
    assert_close_rel(losses[:3], reference.losses, rel=REL)
    assert_close_rel(
        [m["grad_norm"] for m in recipe_run.metrics[:3]], [m["grad_norm"] for m in reference.metrics], rel=REL
    )


@pytest.mark.slow
def test_tiny_recipe_compiles_nothing_after_step_2(recipe_run):
    first, second = recipe_run.metrics[0], recipe_run.metrics[1]
    assert first["compiles_fwd"] >= 4, first  # both blocks really compiled (pieces split at the nested units)
    assert first["graph_breaks"] >= 2, first  # the FSDP2 hooks of the nested expert / router units
    for record in recipe_run.metrics[2:]:
        assert {k: record[k] for k in COUNTS} == {k: second[k] for k in COUNTS}, (record["step"], record, second)
    for record in recipe_run.metrics:
        assert record["eager_fallbacks"] == 0, record
        assert record["compiles_bwd"] == record["recompiles_bwd"] == 0, record  # backward ran on the training thread


@pytest.mark.slow
def test_field_failure_without_the_workarounds(recipe_run, tmp_path):
    """The recipe that just trained, with only nemo_ac's SAC workarounds switched off: torch 2.13's error from the
    field, raised as SACDesyncError naming the decoder block, the profiler op and the remedy."""
    run = run_recipe(
        RECIPE,
        nproc=4,
        run_dir=tmp_path / "off",
        overrides=["activation_checkpointing.workarounds=false", "train.steps=1", "train.warmup_steps=1"],
        timeout=1500,
    )
    assert run.returncode != 0 and not run.metrics, run.output[-3000:]
    assert re.search(FIELD_ERROR, run.output), run.output[-6000:]
    assert "SACDesyncError: selective activation checkpointing desynced in region 'model.language_model.layers." in (
        run.output
    )
    assert "profiler op: True" in run.output and "nemo_ac SAC workarounds: off" in run.output
    assert "remedy: set activation_checkpointing.workarounds: true" in run.output


@pytest.fixture(scope="module")
def worker_cells(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vl_worker")
    proc = run_script(WORKER, nproc=2, args=[str(tmp / "cells.json"), str(tmp / "ckpt")], timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads((tmp / "cells.json").read_text())["cells"]


def test_frozen_vision_tower_gets_no_optimizer_state_and_no_gradient_reduction(worker_cells):
    frozen, trainable = worker_cells["frozen"], worker_cells["trainable"]
    assert frozen["tower_params"] == trainable["tower_params"] > 0
    assert frozen["tower_in_optimizer"] == frozen["tower_with_state"] == frozen["tower_changed"] == []
    assert len(trainable["tower_with_state"]) == len(trainable["tower_changed"]) == trainable["tower_params"]
    assert frozen["others_unchanged"] == []  # everything else trained
    # FSDP2 reduce-scatters once per unit per micro batch: the vision block's unit reduces nothing when frozen, and
    # the root unit leaves the patch embedding and position table out: exactly the tower's elements, per micro batch.
    micro_batches = frozen["micro_batches"]
    assert trainable["reduce_scatter_calls"] - frozen["reduce_scatter_calls"] == micro_batches  # one vision block
    saved = trainable["reduce_scatter_elements"] - frozen["reduce_scatter_elements"]
    assert saved == micro_batches * frozen["tower_padded_elements"], (saved, frozen)
    assert frozen["loss"] == trainable["loss"]  # same data, same weights: freezing changes no forward math


def test_optimizer_states_on_the_host_train_bitwise_as_on_the_device(worker_cells):
    """fp32 on 2 gloo ranks (EP2 x CP2, FSDP2): AdamW with its states offloaded to host memory gives the same
    losses and parameters, bit for bit, as torch's AdamW with them on the device."""
    offloaded, on_device = worker_cells["straight"], worker_cells["on_device"]
    assert (offloaded["optimizer"], on_device["optimizer"]) == ("AdamWHostStates", "AdamW")
    assert offloaded["losses"] == on_device["losses"]
    assert offloaded["parameters"] == on_device["parameters"]


def test_resumed_run_continues_on_the_same_medpix_rows(worker_cells):
    straight, resumed = worker_cells["straight"], worker_cells["resumed"]
    assert resumed["restored_step"] == 2 and resumed["position"]["next_step"] == 2
    assert resumed["position"]["plan_row"] > 0 and resumed["position"]["plan_cursor"] > 0
    assert resumed["losses"] == straight["losses"][2:]  # bitwise: same rows, weights and optimizer state
