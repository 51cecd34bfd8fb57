"""Parity at the layouts clusters run: every parameter's gradient and every step's loss of a parallel run equal one
process (``tests.parity``: per-parameter gradients by name, one tolerance table).

Every run packs variable-length documents into rows whose length changes every step (``data.fixed_length=false``;
with seed 2 the steps are 60, 72, 96, 60, 96, 84 tokens long: divisible by 2*cp, never a model dimension).
``micro_batch_size * dp`` is 4 everywhere, so every micro step covers the same global rows and one world-size-1
run per dtype serves every cell. One torchrun launch per world size (1, 2, 4, 8) runs its cells in sequence
(``tests/functional/workers/parity.py``); the gradients compared are those of step 1, before any optimizer step.

The parity table (cell, ranks, dtype, max per-parameter gradient difference relative to that gradient's largest
entry, max loss difference relative) is printed by ``pytest -s tests/functional/test_parity.py``.
"""

from __future__ import annotations

import pytest

from tests.parity import AC_ON_VS_OFF, TOLERANCES, assert_parity, run_parity_cells

pytestmark = pytest.mark.functional

RECIPE = "tiny/qwen3_moe_tiny.yaml"
DATA = ["data.fixed_length=false", "data.seq_len=96", "data.pad_multiple=12"]
COMMON = ["train.seed=2", "train.global_batch_size=8", "activation_checkpointing.mode=none", *DATA, "train.steps=3"]
BF16 = ["parallel.fsdp.param_dtype=bfloat16", "parallel.fsdp.reduce_dtype=float32", "model.moe.router_dtype=float32"]
RING_EP = ["parallel.dp_shard=2", "parallel.cp=2", "parallel.cp_type=ring", "parallel.ep=2", "train.micro_batch_size=2"]
EXPLICIT = ["parallel.fsdp.forward_prefetch=explicit", "parallel.fsdp.backward_prefetch=explicit"]

# world size -> {cell: (overrides, dtype)}; the reference of a cell is ws1/<dtype>.
CELLS: dict[int, dict[str, tuple[list[str], str]]] = {
    1: {
        "ws1/float32": (["train.micro_batch_size=4"], "float32"),
        "ws1/bfloat16": (["train.micro_batch_size=4", *BF16], "bfloat16"),
    },
    2: {
        "ep2": (["parallel.ep=2", "train.micro_batch_size=2"], "float32"),
        "cp2_ulysses": (["parallel.cp=2", "parallel.cp_type=ulysses", "train.micro_batch_size=4"], "float32"),
        "cp2_ring": (["parallel.cp=2", "parallel.cp_type=ring", "train.micro_batch_size=4"], "float32"),
        # Experts and an fp32 router as nested FSDP units, explicit prefetch, the EP and ring all-to-alls inside
        # the checkpointed block: the layout that exposes the SAC desync.
        "selective_ep2_cp2_ring_explicit": (
            [
                "parallel.cp=2",
                "parallel.cp_type=ring",
                "parallel.ep=2",
                "train.micro_batch_size=4",
                "activation_checkpointing.mode=selective",
                "model.moe.router_dtype=float32",
                *EXPLICIT,
            ],
            "float32",
        ),
        # AC(compile(block)) with ring CP and EP, backward on its own thread (the CUDA autograd-thread situation),
        # 6 steps: no thread compiles anything after step 2.
        "compiled_full_ep2_cp2_ring_bwd_thread": (
            [
                "train.steps=6",
                "train.micro_batch_size=4",
                "train.backward_on_thread=true",
                "parallel.cp=2",
                "parallel.cp_type=ring",
                "parallel.ep=2",
                "activation_checkpointing.mode=full",
                "compile.enabled=true",
                "compile.layout=ac_outer",
            ],
            "float32",
        ),
        # Selective AC over inductor-compiled blocks with ring CP (the SAC x inductor fix: without
        # wrap_inductor_compiled_regions the grad norm came out 3.5% off with no error).
        "compiled_selective_cp2_ring": (
            [
                "train.micro_batch_size=4",
                "parallel.cp=2",
                "parallel.cp_type=ring",
                "activation_checkpointing.mode=selective",
                "compile.enabled=true",
                "compile.layout=ac_outer",
            ],
            "float32",
        ),
    },
    4: {
        "ep2_cp2_ring": (RING_EP, "float32"),
        "hsdp_2x2": (["parallel.dp_replicate=2", "parallel.dp_shard=2", "train.micro_batch_size=1"], "float32"),
        "hsdp_2x2_ep2": (
            ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2", "train.micro_batch_size=1"],
            "float32",
        ),
        # bf16 params, fp32 reduce, the fp32 router as its own unit, real EP, explicit prefetch, selective AC and
        # inductor, over ring CP; and the same layout compiled without AC (what AC changes under compile).
        "bf16_compiled_selective_ep2_cp2_ring_explicit": (
            [*RING_EP, *BF16, *EXPLICIT, "activation_checkpointing.mode=selective", "compile.enabled=true"],
            "bfloat16",
        ),
        "bf16_compiled_ep2_cp2_ring_explicit": ([*RING_EP, *BF16, *EXPLICIT, "compile.enabled=true"], "bfloat16"),
    },
    8: {
        "hsdp_2x2_cp2_ring_ep2": (
            [
                "parallel.dp_replicate=2",
                "parallel.dp_shard=2",
                "parallel.cp=2",
                "parallel.cp_type=ring",
                "parallel.ep=2",
                "train.micro_batch_size=1",
            ],
            "float32",
        ),
    },
}


# Not parity cells (run in the 2-rank launch): fixed-length rows whose document layout, and with it the ring's
# per-micro-batch ints (max_seqlen_q/k, local_k_slice) and cu_seqlens' length, changes every micro batch, compiled
# with and without compile.dynamic_ints.
RING_INTS = [
    "data.fixed_length=true",
    "train.micro_batch_size=4",
    "parallel.cp=2",
    "parallel.cp_type=ring",
    "compile.enabled=true",
    "compile.backend=aot_eager",
]
EXTRA_CELLS = {
    2: {
        "ring_dynamic_ints_on": [*RING_INTS, "compile.dynamic_ints=true"],
        "ring_dynamic_ints_off": [*RING_INTS, "compile.dynamic_ints=false"],
    }
}


WATCH_DTYPES = {"bf16_compiled_selective_ep2_cp2_ring_explicit"}  # the worker records the router's dtypes


def launch(world_size: int, out_dir) -> dict[str, dict]:
    cells = [
        {
            "name": name.replace("/", "_"),
            "recipe": RECIPE,
            "overrides": [*COMMON, *overrides],
            "watch_dtypes": name in WATCH_DTYPES,
        }
        for name, (overrides, _) in CELLS[world_size].items()
    ] + [
        {"name": name, "recipe": RECIPE, "overrides": [*COMMON, *overrides]}
        for name, overrides in EXTRA_CELLS.get(world_size, {}).items()
    ]
    return run_parity_cells(cells, world_size=world_size, out_dir=out_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for world_size in CELLS:
        merged.update(launch(world_size, tmp_path_factory.mktemp(f"ws{world_size}")))
    return merged


TABLE: list[tuple[str, int, str, float, float]] = []


@pytest.mark.parametrize(
    "name", [name for ws, cells in CELLS.items() if ws > 1 for name in cells], ids=lambda name: name
)
def test_parallel_layout_matches_one_process(runs, name: str) -> None:
    cell = runs[name]
    dtype = CELLS[cell["world_size"]][name][1]
    reference = runs[f"ws1_{dtype}"]
    steps = len(reference["losses"])
    grad, loss = assert_parity(
        name=name,
        grads=cell["grads"],
        losses=cell["losses"][:steps],
        reference_grads=reference["grads"],
        reference_losses=reference["losses"],
        tolerance=TOLERANCES[dtype],
    )
    TABLE.append((name, cell["world_size"], dtype, grad, loss))
    print(f"\nparity | {name} | {cell['world_size']} ranks | {dtype} | grad {grad:.2e} | loss {loss:.2e}")


def test_bf16_router_stays_fp32_and_compile_never_falls_back(runs) -> None:
    cell = runs["bf16_compiled_selective_ep2_cp2_ring_explicit"]
    assert cell["dtypes"] == {
        "router_weight": "float32",  # its own FSDP unit with an fp32 mixed-precision policy
        "router_logits": "float32",
        "router_scores": "float32",
        "experts_weight": "bfloat16",  # mixed precision really is on
        "experts_output": "bfloat16",
    }, cell["dtypes"]
    assert cell["compile"]["eager_fallbacks"] == 0 and cell["compile"]["compiles_fwd"] > 0, cell["compile"]
    # Selective AC vs none, both compiled, same layout: bitwise equal (measured on CPU; tests.parity).
    no_ac = runs["bf16_compiled_ep2_cp2_ring_explicit"]
    grad, loss = assert_parity(
        name="bf16 compiled: selective AC vs no AC",
        grads=cell["grads"],
        losses=cell["losses"],
        reference_grads=no_ac["grads"],
        reference_losses=no_ac["losses"],
        tolerance=AC_ON_VS_OFF,
    )
    print(f"\nparity | bf16 compiled selective AC vs no AC | 4 ranks | grad {grad:.2e} | loss {loss:.2e}")


def test_compiled_ring_ep_never_recompiles_after_step_2(runs) -> None:
    """The ring's per-micro-batch ints are dynamic from the first compile; the row length changes between steps 1
    and 2, which makes the sequence dims dynamic there; from then on nothing compiles, on any thread."""
    compiles = runs["compiled_full_ep2_cp2_ring_bwd_thread"]["compiles_per_step"]
    assert len(compiles) == 6
    assert compiles[0].get("MainThread:DYNAMO", 0) > 0, compiles  # compile really ran
    assert compiles[-1] == compiles[1], f"new compiles after step 2 (cumulative per thread, per step): {compiles}"


def test_ring_ints_are_dynamic_from_the_first_compile(runs) -> None:
    """The real ring op on packed rows whose layout changes every micro batch (6 micro batches): with
    ``compile.dynamic_ints`` the blocks compile once and never again; without it Dynamo first specializes the
    ints and recompiles when they change (``workarounds.dynamic_per_batch_ints``)."""
    on, off = runs["ring_dynamic_ints_on"]["compile"], runs["ring_dynamic_ints_off"]["compile"]
    assert on["compiles_fwd"] > 0 and on["recompiles_fwd"] == 0 and on["eager_fallbacks"] == 0, on
    assert off["recompiles_fwd"] > 0, off
    reasons = " ".join(off.get("recompile_reasons_fwd", {}))
    assert any(name in reasons for name in ("max_seqlen", "local_k_slice", "cu_seqlens")), reasons
