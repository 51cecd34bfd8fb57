"""SAC under every FSDP2 layout on 4 gloo ranks: one torchrun launch (tests/functional/workers/sac_layouts.py).

Regression (explicit forward + backward prefetch, selective AC, nested expert units):
- workarounds off -> torch's SAC storage error, raised as SACDesyncError naming the block;
- the profiler-op ignore alone -> still fails, on FSDP's own all-gather op (why the FSDP-hook bracket exists);
- both workarounds -> trains.

Layout matrix, selective AC: {placement inside, outside} x {forward prefetch none, explicit (next block + its
experts)} x {backward prefetch default, explicit} x {ep 1, ep 2: the real expert-parallel dispatcher, its
all-to-all inside the checkpointed block} x {fp32, bf16 params}; plus full AC and a backward on another thread.
Every cell trains 2 steps and must equal the no-AC run of the same EP size and dtype: the losses, and every
parameter's gradient after step 1 (``tests.parity``).

Tolerance: exactly equal (``tests.parity.AC_ON_VS_OFF``), in fp32 and in bf16. SAC decides only whether a value is
replayed from forward or recomputed; on CPU (gloo, OMP_NUM_THREADS=1) every kernel is deterministic, so the
recomputed value is bitwise the forward's. Any bound would only hide a replayed value that belongs to another op
(a SAC index shift), which is the bug class this test exists to catch. The bf16 runs are checked to differ from
fp32, so mixed precision really is on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import assert_close_rel, run_script
from tests.parity import AC_ON_VS_OFF

pytestmark = pytest.mark.functional

WORKER = Path(__file__).parent / "workers" / "sac_layouts.py"
FSDP_ALL_GATHER_OPS = {"fsdp.all_gather_copy_in.default", "c10d._allgather_base_.default", "aten.empty.memory_format"}


@pytest.fixture(scope="module")
def cells(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("sac_layouts") / "cells.json"
    proc = run_script(WORKER, nproc=4, args=[str(out), "regression,matrix"], timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return {cell["name"]: cell for cell in json.loads(out.read_text())["cells"]}


def test_explicit_prefetch_without_workarounds_fails_with_the_sac_error(cells):
    cell = cells["explicit/off"]
    assert not cell["ok"] and cell["error_type"] == "SACDesyncError", cell
    assert "encountered during backward but not found in storage" in cell["cause"], cell["cause"]
    assert cell["region"].startswith("model.layers.") and cell["origin"] in ("profiler", "fsdp", "fsdp_or_model")


def test_profiler_ignore_alone_is_not_enough_with_explicit_prefetch(cells):
    cell = cells["explicit/profiler_only"]
    assert not cell["ok"] and cell["error_type"] == "SACDesyncError", cell
    assert cell["op"] in FSDP_ALL_GATHER_OPS, cell["error"]
    assert "FSDP op: True" in cell["error"]


def test_explicit_prefetch_with_workarounds_trains(cells):
    cell = cells["explicit/on"]
    assert cell["ok"], cell.get("traceback")
    reference = cells["reference/ep=1/float32"]
    assert_close_rel(cell["losses"], reference["losses"], rel=AC_ON_VS_OFF.loss)


def test_every_layout_trains_and_matches_no_ac(cells):
    references = {(c["ep"], c["dtype"]): c for c in cells.values() if c.get("kind") == "reference"}
    assert len(references) == 4 and all(
        c["ok"] and "activation_checkpointing.mode=none" in c["overrides"] for c in references.values()
    )
    checked = [c for c in cells.values() if c.get("kind") in ("selective", "full")]
    failures = [f"{c['name']}: {c.get('error', '')[:400]}" for c in checked if not c["ok"]]
    assert not failures, "\n".join(failures)
    selective = [c for c in checked if c["kind"] == "selective"]
    assert len(selective) == 2 * 2 * 2 * 2 * 2 + 1 and sum(c["kind"] == "full" for c in checked) == 2
    for cell in checked:
        ref = references[(cell["ep"], cell["dtype"])]
        assert len(cell["losses"]) == 2, cell["name"]
        assert_close_rel(cell["losses"], ref["losses"], rel=AC_ON_VS_OFF.loss)
        assert_close_rel(cell["grad_norms"], ref["grad_norms"], rel=AC_ON_VS_OFF.loss)
        assert cell["max_grad_diff"] <= AC_ON_VS_OFF.grad, (cell["name"], cell["max_grad_diff"])
    for ep in (1, 2):
        fp32, bf16 = references[(ep, "float32")]["losses"], references[(ep, "bfloat16")]["losses"]
        assert fp32[0] != bf16[0], "bf16 mixed precision did not change the numerics"
        assert fp32[1] < fp32[0] and bf16[1] < bf16[0]
