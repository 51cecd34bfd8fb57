"""Checkpoints of the low-precision optimizer policies on real torchrun launches (FSDP2 over gloo, DCP on disk):
bf16 masters and moments, and fp8 moments, each saved in its own dtypes, resumed bitwise, and (fp8) resharded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launch import assert_close_rel, checkpointing, records, run_recipe

pytestmark = pytest.mark.functional

RECIPE = "tiny/qwen3_moe_tiny.yaml"
# The tiny recipe's micro_batch_size 2 at 2 ranks: 4 global rows per micro step, kept for every world size.
COMMON = ["train.steps=6", "train.global_batch_size=8", "checkpoint.keep_last=2"]


BF16_MASTERS = [
    "parallel.fsdp.param_dtype=bfloat16",
    "train.master_dtype=bfloat16",
    "train.optimizer_state_dtype=bfloat16",
]


def test_bf16_masters_are_sharded_and_saved_in_bf16_and_resume_bitwise(tmp_path):
    """``train.master_dtype=bfloat16`` with bf16 moments (8 bytes per parameter, NeMo Automodel's benchmark setting):
    the DCP checkpoint holds the sharded weights and both moments in bf16 (FSDP shards what ``cast_masters`` cast),
    a run killed after step 3 and resumed is bitwise the uninterrupted one (the rounding noise is seeded by
    parameter and step), and FSDP2's CPUOffloadPolicy steps the same bf16 masters on the host bit for bit."""
    from torch.distributed.checkpoint import FileSystemReader

    straight = run_recipe(RECIPE, nproc=2, run_dir=tmp_path / "straight", overrides=[*COMMON, *BF16_MASTERS]).check()
    assert "| bfloat16 masters" in straight.output
    ckpt = tmp_path / "ckpt"
    stopped = run_recipe(
        RECIPE,
        nproc=2,
        run_dir=tmp_path / "stopped",
        overrides=[*COMMON, *BF16_MASTERS, *checkpointing(ckpt, every=3), "train.fail_after_step=3"],
    )
    assert stopped.returncode != 0, stopped.output[-3000:]
    stored = FileSystemReader(str(ckpt / "step_3")).read_metadata().state_dict_metadata
    dtypes = {key: getattr(getattr(meta, "properties", None), "dtype", None) for key, meta in stored.items()}
    weights = {dtypes[key] for key in dtypes if key.startswith("model.") and key.endswith("proj.weight")}
    moments = {dtypes[key] for key in dtypes if key.endswith(("exp_avg", "exp_avg_sq"))}
    assert weights == {torch.bfloat16} and moments == {torch.bfloat16}, dtypes
    resumed = run_recipe(
        RECIPE, nproc=2, run_dir=tmp_path / "resumed", overrides=[*COMMON, *BF16_MASTERS, *checkpointing(ckpt, every=3)]
    ).check()
    assert f"resumed from {ckpt / 'step_3'} at step 3" in resumed.output
    assert records(resumed, "loss")[-3:] == straight.losses[3:]
    assert records(resumed, "grad_norm")[-3:] == records(straight, "grad_norm")[3:]
    on_host = run_recipe(
        RECIPE,
        nproc=2,
        run_dir=tmp_path / "on_host",
        overrides=[*COMMON, *BF16_MASTERS, "train.optimizer_offload=full"],
    ).check()
    assert on_host.losses == straight.losses


def _fp8_moments(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Each quantized parameter's first moment, dequantized from the checkpoint's global codes and scales."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from nemo_ac.trainer import adamw_fp8_states as fp8

    flat = tmp_path / f"{checkpoint.parent.parent.name}_{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(flat))
    state = torch.load(flat, weights_only=False)["optim"]["state"]
    return {
        name: fp8.moments_in_fp32(states, states[fp8.EXP_AVG].shape[-1])[0]
        for name, states in state.items()
        if fp8.EXP_AVG in states
    }


def test_fp8_states_are_saved_as_codes_and_scales_resume_bitwise_and_reshard(tmp_path):
    """``train.optimizer_state_dtype=float8``: the DCP checkpoint holds e4m3 codes with the parameters' global
    shapes and fp32 scales per 128 elements of a row; resumed from step 3 at world size 2 the run is bitwise the
    uninterrupted one; resumed at world size 1 (each rank's rows, and so its blocks, now another
    shard's, so its rounding noise another) it continues the curve, and its step-6 moments are the uninterrupted
    run's to fp8 rounding (two independent roundings of up to 2^-3 each: measured 2-8% per parameter, in norm);
    the blocks survived the resharding (a moment compared with its rows shifted by one differs by 120-170%)."""
    from torch.distributed.checkpoint import FileSystemReader

    fp8_states = ["train.optimizer_state_dtype=float8"]
    straight = run_recipe(
        RECIPE,
        nproc=2,
        run_dir=tmp_path / "straight",
        overrides=[*COMMON, *fp8_states, *checkpointing(tmp_path / "straight_ckpt", every=3)],
    ).check()
    step_3 = tmp_path / "straight_ckpt" / "step_3"  # resumed from as a killed run would be (test_checkpoint_resume.py)
    stored = FileSystemReader(str(step_3)).read_metadata().state_dict_metadata
    codes = {key: meta for key, meta in stored.items() if key.endswith(".exp_avg_fp8")}
    scales = {key: meta for key, meta in stored.items() if key.endswith(".exp_avg_scale")}
    assert codes and {meta.properties.dtype for meta in codes.values()} == {torch.float8_e4m3fn}
    for key, meta in codes.items():
        weight = stored[key.replace("optim.state.", "model.").removesuffix(".exp_avg_fp8")]
        assert meta.size == weight.size
        scale = scales[key.replace(".exp_avg_fp8", ".exp_avg_scale")]
        assert scale.properties.dtype == torch.float32
        assert tuple(scale.size) == (*weight.size[:-1], (weight.size[-1] + 127) // 128)
    resumed = run_recipe(
        RECIPE,
        nproc=2,
        run_dir=tmp_path / "resumed",
        overrides=[*COMMON, *fp8_states, *checkpointing(tmp_path / "resumed_ckpt", every=3, resume=str(step_3))],
    ).check()
    assert f"resumed from {step_3} at step 3" in resumed.output
    assert records(resumed, "loss")[-3:] == straight.losses[3:]
    resharded = run_recipe(
        RECIPE,
        nproc=1,
        run_dir=tmp_path / "resharded",
        overrides=[
            *COMMON, *fp8_states, "train.micro_batch_size=4",
            *checkpointing(tmp_path / "resharded_ckpt", every=3, resume=str(step_3)),
        ],
    ).check()  # fmt: skip
    assert "saved at world size 2, resharded to 1" in resharded.output
    assert_close_rel(resharded.losses, straight.losses[3:], rel=1e-3)  # measured: 3e-5
    ours = _fp8_moments(tmp_path / "resharded_ckpt" / "step_6", tmp_path)
    theirs = _fp8_moments(tmp_path / "straight_ckpt" / "step_6", tmp_path)
    assert ours.keys() == theirs.keys() and ours
    for name, moment in theirs.items():
        difference = (ours[name] - moment).norm() / moment.norm()
        assert difference < 0.2, (name, difference.item())
